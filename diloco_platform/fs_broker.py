"""The embedded default's broker: kombu's filesystem transport, with atomic writes.

kombu's filesystem transport writes a message in place (`open(name.msg, 'wb')`, write,
close) while a consumer in another process may already have listed, moved and read the
file: it then reads an empty or partial message, and the worker dies with a
JSONDecodeError ("Unrecoverable error"). This subclass writes each message under a name
the consumers ignore and renames it into place, which is atomic on one filesystem.
Selected by CELERY_BROKER_TRANSPORT in settings when REDIS_URL is unset.
"""
from __future__ import annotations

import os
import uuid
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        tmp = final + ".part"  # consumers only take names ending in '<queue>.msg'
        try:
            with open(tmp, "wb") as fh:
                fh.write(str_to_bytes(dumps(payload)))
            os.replace(tmp, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
