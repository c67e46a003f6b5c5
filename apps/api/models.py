"""Per-user API tokens: several named tokens per user, only a hash is stored."""
from __future__ import annotations

import functools
import hashlib
import secrets

from django.conf import settings
from django.db import connection, models
from django.utils import timezone

TOKEN_PREFIX = "dl_"  # noqa: S105  (a public marker, not a secret)


class ApiToken(models.Model):
    """A personal API credential (CI pipelines, the CLI). The raw key is shown once."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=60)
    prefix = models.CharField(max_length=12, help_text="last characters of the key, to recognise it")
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["user", "revoked_at"])]

    def __str__(self) -> str:
        return f"{self.user} {self.name} …{self.prefix}"

    @staticmethod
    def hash(raw: str) -> str:
        return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()

    @property
    def is_active(self) -> bool:
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()

    @classmethod
    def issue(cls, user, name: str = "cli", expires_at=None) -> tuple[ApiToken, str]:
        """Create a token; returns (row, raw key). Only the hash is kept."""
        raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
        tok = cls.objects.create(user=user, name=name, prefix=raw[-6:], key_hash=cls.hash(raw),
                                 expires_at=expires_at)
        return tok, raw

    @classmethod
    def lookup(cls, raw: str) -> ApiToken | None:
        """The active token for this raw key, or None."""
        if not raw or not raw.startswith(TOKEN_PREFIX) or len(raw) > 100:
            return None
        key = cls.hash(raw)
        if connection.vendor == "postgresql":
            tok = _lookup_postgres(key)
        else:
            tok = cls.objects.select_related("user").filter(key_hash=key, revoked_at__isnull=True).first()
        if tok is None or not tok.is_active or not tok.user.is_active:
            return None
        return tok

    def revoke(self) -> None:
        if self.revoked_at is None:
            self.revoked_at = timezone.now()
            self.save(update_fields=["revoked_at"])


# --- the token lookup on PostgreSQL ------------------------------------------------------------
# Every API request starts here. Through the ORM it cost about 0.6 ms of the web process's CPU,
# half of it building and compiling the same query again, and the user's teams (which jobs they
# may see: apps.jobs.access) took a second query of 0.3 ms (issue 19's profile). One hand-written
# statement brings the token, its user and the user's team names; the instances are built with
# Model.from_db, as the ORM builds them. Other databases keep the ORM query.


@functools.cache
def _token_statement() -> tuple[str, list[str], list[str]]:
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    qn = connection.ops.quote_name
    groups = user_model._meta.get_field("groups")
    group_model = groups.related_model
    t_fields = [f.attname for f in ApiToken._meta.concrete_fields]
    u_fields = [f.attname for f in user_model._meta.concrete_fields]
    t_cols = ", ".join(f"t.{qn(f.column)}" for f in ApiToken._meta.concrete_fields)
    u_cols = ", ".join(f"u.{qn(f.column)}" for f in user_model._meta.concrete_fields)
    teams = (f"ARRAY(SELECT g.{qn(group_model._meta.get_field('name').column)} "  # noqa: S608 - model names
             f"FROM {qn(group_model._meta.db_table)} g JOIN {qn(groups.m2m_db_table())} ug "
             f"ON ug.{qn(groups.m2m_reverse_name())} = g.{qn(group_model._meta.pk.column)} "
             f"WHERE ug.{qn(groups.m2m_column_name())} = u.{qn(user_model._meta.pk.column)})")
    user_fk = ApiToken._meta.get_field("user")
    sql = (f"SELECT {t_cols}, {u_cols}, {teams} "  # noqa: S608 - names from the models, the key a parameter
           f"FROM {qn(ApiToken._meta.db_table)} t JOIN {qn(user_model._meta.db_table)} u "
           f"ON u.{qn(user_model._meta.pk.column)} = t.{qn(user_fk.column)} "
           f"WHERE t.{qn(ApiToken._meta.get_field('key_hash').column)} = %s "
           f"AND t.{qn(ApiToken._meta.get_field('revoked_at').column)} IS NULL")
    return sql, t_fields, u_fields


def _lookup_postgres(key_hash: str) -> ApiToken | None:
    """The unrevoked token with this hash, its user loaded and the user's team names attached
    (`loaded_team_names`, read by apps.jobs.access.team_names), or None."""
    from django.contrib.auth import get_user_model

    sql, t_fields, u_fields = _token_statement()
    with connection.cursor() as cur:
        cur.execute(sql, [key_hash])
        row = cur.fetchone()
    if row is None:
        return None
    n = len(t_fields)
    tok = ApiToken.from_db(connection.alias, t_fields, row[:n])
    user = get_user_model().from_db(connection.alias, u_fields, row[n:n + len(u_fields)])
    user.loaded_team_names = list(row[-1])
    ApiToken._meta.get_field("user").set_cached_value(tok, user)
    return tok
