"""Settings, read from the environment (12-factor).

Embedded default (nothing set): SQLite under var/, Celery's filesystem broker, the
in-memory channel layer, blobs under var/blobs. Services: set DATABASE_URL, REDIS_URL and
BLOB_STORE_URL. See docs/configuration.md for every variable.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(environ.Env().str("DILOCO_VAR_DIR", default=str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

env = environ.Env(
    DEBUG=(bool, False),
    ALLOWED_HOSTS=(list, ["127.0.0.1", "localhost", "[::1]", "testserver"]),
)

# GENERAL
DEBUG = env("DEBUG")
# The embedded default (no DATABASE_URL: SQLite under var/) is one host: its secrets are random,
# made once into var/ and shared by its processes. Any other start must be given SECRET_KEY.
EMBEDDED = not env.str("DATABASE_URL", default="") and not env.bool("DILOCO_PRODUCTION", default=False)


def _local_secret(name: str) -> str:
    """A random secret kept in VAR_DIR/<name> (mode 0600), made by whichever process comes first."""
    import os
    import secrets

    path = VAR_DIR / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(50))
    for _ in range(50):  # another process may be writing it right now
        value = path.read_text().strip()
        if value:
            return value
        import time

        time.sleep(0.01)
    raise RuntimeError(f"{path} is empty; delete it to make a new secret")


SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY:
    if not EMBEDDED:  # one line on stderr and exit status 1, from manage.py, daphne and celery alike
        raise SystemExit(
            "SECRET_KEY must be set (python -c 'import secrets; print(secrets.token_urlsafe(50))'); "
            "only the embedded default (no DATABASE_URL) makes its own, in var/secret_key"
        )
    SECRET_KEY = _local_secret("secret_key")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
TIME_ZONE = "UTC"
USE_TZ = True
LANGUAGE_CODE = "en-us"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# APPS
INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI served locally, no CDN
    "channels",
    "django_celery_beat",
    "apps.inventory",
    "apps.jobs",
    "apps.coordinator",
    "apps.telemetry",
    "apps.api",
    "apps.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "diloco_platform.csp.ContentSecurityPolicyMiddleware",  # script and style sources (csp.py)
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "diloco_platform.urls"
WSGI_APPLICATION = "diloco_platform.wsgi.application"
ASGI_APPLICATION = "diloco_platform.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# DATABASES
DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}")}
DATABASES["default"]["ATOMIC_REQUESTS"] = False
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Several processes (web, workers) share the file in the embedded default.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 30
    # Take the write lock at BEGIN: a deferred transaction that upgrades from read to write
    # gets "database is locked" at once, without waiting for the timeout. WAL lets readers
    # and the writer overlap.
    DATABASES["default"]["OPTIONS"]["transaction_mode"] = "IMMEDIATE"
    DATABASES["default"]["OPTIONS"]["init_command"] = "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
else:
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=0)
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    # A host cut off from the database (a partition between sites) must not leave its connections
    # waiting on TCP's retransmission backoff, which reached a minute after a 60 s partition in the
    # sites drill: unacknowledged data fails after DB_TCP_USER_TIMEOUT_S, idle connections are
    # probed, and the next query reconnects once the link is back.
    DATABASES["default"].setdefault("OPTIONS", {}).update({
        "connect_timeout": env.int("DB_CONNECT_TIMEOUT_S", default=10),
        "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
        "tcp_user_timeout": int(env.float("DB_TCP_USER_TIMEOUT_S", default=20) * 1000),
    })
    # A connection pool per process (psycopg_pool, Django's OPTIONS["pool"]): the web process
    # turns it on (gunicorn_conf), since under ASGI each request runs on a thread of its own and
    # would otherwise open a PostgreSQL connection of its own (docs/configuration.md, DB_POOL).
    if env.bool("DB_POOL", default=False):
        if DATABASES["default"]["CONN_MAX_AGE"]:
            raise SystemExit("DB_POOL and CONN_MAX_AGE exclude each other: set one of them")
        from diloco_platform.db_pool import pool_options

        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = pool_options(env)

# REDIS / CELERY / CHANNELS
REDIS_URL = env.str("REDIS_URL", default="")
BROKER_DIR = VAR_DIR / "broker"
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # channels-redis blocks 5 s in BZPOPMIN; redis-py's default socket timeout is also 5 s,
            # so idle consumers raised "Timeout reading from ..." every few seconds. The socket
            # timeout must outlast the blocking read; a dropped connection still fails at once.
            "CONFIG": {
                "hosts": [{"address": REDIS_URL, "socket_timeout": 15}],
                "capacity": 1500,
                "expiry": 30,
            },
        }
    }
else:
    # Embedded default: a broker that needs no server (polls a folder, ~1 s latency).
    CELERY_BROKER_URL = "filesystem://localhost//"  # a host, or kombu warns at every connection
    CELERY_BROKER_TRANSPORT = "diloco_platform.fs_broker:Transport"  # atomic message writes
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "out"),
        "data_folder_out": str(BROKER_DIR / "out"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "control_folder": str(BROKER_DIR / "control"),  # broadcast exchanges (default: ./control)
        "store_processed": False,
    }
    for sub in ("out", "processed", "control"):
        (BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "coordinator"
# Syncer shards the coordinator runs at once: the threads of the syncer worker(s) (`-Q syncer
# --concurrency ${SYNCER_SLOTS:-8}`, diloco_platform.processes). Placement admits a job only while
# its shards fit beside those of the running jobs (it waits queued otherwise); a spec asking for
# more syncer_shards than this is refused at submission.
SYNCER_SLOTS = max(1, env.int("SYNCER_SLOTS", default=8))  # = processes.SYNCER_SLOTS_DEFAULT
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# BLOBS
BLOB_STORE_URL = env.str("BLOB_STORE_URL", default=f"file://{VAR_DIR / 'blobs'}")

# DATA: job specs may only read files under these roots ("stdlib" is always allowed).
DATA_ROOTS = [Path(p).resolve() for p in env.list("DATA_ROOTS", default=[str(BASE_DIR / "data")])]
# MODEL: the `module:function` model factories job specs may name (presets are always allowed).
# Empty by default: a factory is code the coordinator and every worker import and call.
MODEL_FACTORIES = env.list("MODEL_FACTORIES", default=[])

# PLATFORM
WEB_URL = env.str("DILOCO_WEB_URL", default="http://127.0.0.1:8000")
HEARTBEAT_INTERVAL_S = env.float("HEARTBEAT_INTERVAL_S", default=1.0)
HEARTBEAT_TIMEOUT_S = env.float("HEARTBEAT_TIMEOUT_S", default=3.0)
# A learner that fails to start this many times in a row (with back-off between) fails its job.
LEARNER_START_ATTEMPTS = env.int("LEARNER_START_ATTEMPTS", default=5)
# Collectives inside a learner island time out after this (docs/runtime.md, "Learner islands").
ISLAND_TIMEOUT_S = env.float("ISLAND_TIMEOUT_S", default=120.0)

# TELEMETRY (agent websocket; docs/telemetry.md)
# The coordinator's credential on the agent socket: a random secret, never derived from
# SECRET_KEY. Unset: made once into var/coordinator_token (one host: the embedded default,
# the test stack); a deployment over several hosts sets the same value on web and coordinator.
COORDINATOR_TOKEN = env.str("COORDINATOR_TOKEN", default="") or _local_secret("coordinator_token")
WS_MAX_FRAME_BYTES = env.int("WS_MAX_FRAME_BYTES", default=64 * 1024)
TELEMETRY_FLUSH_INTERVAL_S = env.float("TELEMETRY_FLUSH_INTERVAL_S", default=0.5)
TELEMETRY_FLUSH_MAX_ITEMS = env.int("TELEMETRY_FLUSH_MAX_ITEMS", default=1000)
TELEMETRY_SCOPE_TTL_S = env.float("TELEMETRY_SCOPE_TTL_S", default=2.0)
TELEMETRY_ABUSE_LIMIT = env.int("TELEMETRY_ABUSE_LIMIT", default=20)
TELEMETRY_MAX_ITEMS_PER_S = env.float("TELEMETRY_MAX_ITEMS_PER_S", default=5000)
# What one pool token may do (apps/telemetry/guards.py; docs/telemetry.md, "Pool tokens are untrusted")
TELEMETRY_MAX_BYTES_PER_S = env.float("TELEMETRY_MAX_BYTES_PER_S", default=256 * 1024)
TELEMETRY_MAX_SOCKETS_PER_TOKEN = env.int("TELEMETRY_MAX_SOCKETS_PER_TOKEN", default=256)
TELEMETRY_TOKEN_CHECK_S = env.float("TELEMETRY_TOKEN_CHECK_S", default=5.0)
TELEMETRY_MAX_POOL_EVENTS_PER_MIN = env.int("TELEMETRY_MAX_POOL_EVENTS_PER_MIN", default=60)

# PROMETHEUS (/metrics; docs/metrics.md). Off unless one is set; when both are, both must pass.
METRICS_TOKEN = env.str("METRICS_TOKEN", default="")
# e.g. 10.0.0.0/8,127.0.0.1 (a bad entry stops the start with the reason)
METRICS_ALLOWED_NETWORKS = [str(ipaddress.ip_network(n, strict=False))
                            for n in env.list("METRICS_ALLOWED_NETWORKS", default=[])]

# FLEET HOUSEKEEPING (apps/inventory/tasks.py, sent by beat)
# A node silent this long is marked lost; one offline or lost this long is purged (hidden
# from the fleet view, an event says so; its rows and history stay).
NODE_OFFLINE_AFTER_S = env.float("NODE_OFFLINE_AFTER_S", default=30.0)
NODE_PURGE_AFTER_S = env.float("NODE_PURGE_AFTER_S", default=24 * 3600.0)
# Pool and node history (utilisation, tokens/s, power) is sampled this often and kept this long.
FLEET_SAMPLE_INTERVAL_S = env.float("FLEET_SAMPLE_INTERVAL_S", default=10.0)
FLEET_SAMPLE_RETENTION_DAYS = env.float("FLEET_SAMPLE_RETENTION_DAYS", default=30.0)

# AUTH
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

# STATIC
STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise warns on every request when it is missing
STATICFILES_DIRS = [BASE_DIR / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"
        if not DEBUG
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
WHITENOISE_USE_FINDERS = True

# REST FRAMEWORK
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.api.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "apps.api.pagination.BoundedLimitOffsetPagination",
    "DEFAULT_PARSER_CLASSES": ["apps.api.parsers.BoundedJSONParser"],
    # JSON encoded by orjson (apps/api/renderers.py: the same values as DRF's encoder gives)
    "DEFAULT_RENDERER_CLASSES": ["apps.api.renderers.FastJSONRenderer",
                                 "rest_framework.renderers.BrowsableAPIRenderer"],
    "EXCEPTION_HANDLER": "apps.api.exceptions.api_exception_handler",
    "PAGE_SIZE": 50,
    # Rate limits (DRF syntax "N/second|minute|hour|day"); counters live in the default cache.
    "DEFAULT_THROTTLE_RATES": {
        "auth": env.str("API_THROTTLE_AUTH", default="20/minute"),
        "auth_user": env.str("API_THROTTLE_AUTH_USER", default="10/minute"),
        "job_create": env.str("API_THROTTLE_JOB_CREATE", default="60/minute"),
    },
    # Client address for rate limits: REMOTE_ADDR unless N trusted proxies add X-Forwarded-For.
    "NUM_PROXIES": env.int("API_NUM_PROXIES", default=0),
}
# Throttle counters must be shared by every web process: Redis when it is configured.
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "diloco",
        }
    }
SPECTACULAR_SETTINGS = {
    "TITLE": "DiLoCo platform API",
    "DESCRIPTION": "Fleets, jobs, learners and metrics of the Decoupled DiLoCo platform.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "apps.api.schema.add_error_responses",
    ],
    "ENUM_NAME_OVERRIDES": {
        "PoolStateEnum": "apps.inventory.models.Pool.State",
        "NodeStateEnum": "apps.inventory.models.Node.State",
        "LearnerStateEnum": "apps.jobs.models.Learner.State",
    },
}

# SIZE LIMITS
DATA_UPLOAD_MAX_MEMORY_SIZE = env.int("DATA_UPLOAD_MAX_MEMORY_SIZE", default=1024 * 1024)
# Any HTTP body (ASGI, before Django reads it): apps/api/asgi_limits.py answers 413 above this.
REQUEST_BODY_MAX_BYTES = env.int("REQUEST_BODY_MAX_BYTES", default=10 * 1024 * 1024)

# SECURITY (production: DEBUG unset, DILOCO_PRODUCTION=1, HTTPS in front)
if env.bool("DILOCO_PRODUCTION", default=False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
    SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_REDIRECT_EXEMPT = [r"^healthz$"]

# LOGGING
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
    },
}
