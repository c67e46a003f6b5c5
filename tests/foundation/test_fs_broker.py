"""The embedded broker: kombu's filesystem transport with atomic message writes."""

from __future__ import annotations

import threading

from kombu import Connection, Exchange, Queue

from diloco_platform.fs_broker import Transport


def connection(folder):
    return Connection(
        "filesystem://",
        transport=Transport,
        transport_options={
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "control_folder": str(folder / "control"),  # kombu's default is ./control
            "store_processed": False,
        },
    )


def test_messages_round_trip_and_no_partial_file_is_visible(tmp_path):
    q = Queue("pool.x", Exchange("pool.x"), routing_key="pool.x")
    sent = [{"i": i, "blob": "x" * 50_000} for i in range(40)]
    seen_partial = []

    def watch(stop):
        # a consumer lists the folder constantly: it must never see a '.msg' file that is short
        while not stop.is_set():
            for p in tmp_path.iterdir():
                if p.name.endswith(".msg"):
                    try:
                        if p.stat().st_size < 50_000:
                            seen_partial.append(p.name)
                    except FileNotFoundError:
                        pass

    stop = threading.Event()
    t = threading.Thread(target=watch, args=(stop,))
    t.start()
    try:
        with connection(tmp_path) as conn:
            producer = conn.Producer()
            for body in sent:
                producer.publish(
                    body, exchange=q.exchange, routing_key="pool.x", declare=[q], serializer="json"
                )
    finally:
        stop.set()
        t.join()
    assert not seen_partial
    assert not list(tmp_path.glob("*.part"))
    got = []
    with connection(tmp_path) as conn:
        simple = conn.SimpleQueue(q)
        for _ in sent:
            msg = simple.get(timeout=2)
            got.append(msg.payload)
            msg.ack()
        simple.close()
    assert sorted(m["i"] for m in got) == list(range(40))


def test_the_embedded_default_uses_it(tmp_path):
    """With REDIS_URL unset, the Celery app's connection is this transport."""
    import os
    import subprocess
    import sys

    from django.conf import settings

    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env["DILOCO_VAR_DIR"] = str(tmp_path)
    code = (
        "import django; django.setup(); from diloco_platform.celery import app; "
        "c = app.connection_for_write(); print(type(c.transport).__module__, c.as_uri())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=settings.BASE_DIR,
        capture_output=True,
        text=True,
        env={**env, "DJANGO_SETTINGS_MODULE": "diloco_platform.settings"},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "diloco_platform.fs_broker"
