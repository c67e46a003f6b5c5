"""Live sockets follow changes of access at once (see guards.py for the periodic checks).

- a logout closes the dashboard sockets opened with that session;
- a user leaving a team (a Django group), a group deleted, a user deactivated or their
  password changed: their dashboard sockets check their access again now;
- a pool token revoked (saved with `revoked_at`, or deleted): its agent sockets are closed
  (`PoolToken` querysets' `update(revoked_at=...)` call `publish.close_token_sockets` too).

Every message goes after the transaction commits, so the socket reads the new state.
"""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.contrib.auth.signals import user_logged_out
from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_save, pre_delete

from . import publish


def _after_commit(fn) -> None:
    transaction.on_commit(fn, robust=True)


def _logged_out(sender, request=None, user=None, **kwargs) -> None:
    if user is None or getattr(user, "pk", None) is None:
        return
    session = getattr(request, "session", None)
    key = getattr(session, "session_key", None)
    # The session is flushed right after this signal: say which one ends, the sockets of
    # that session close without waiting for the flush; the user's others check again.
    publish._run(publish.agroup_send(publish.user_group(user.pk),
                                     {"type": "access.check", "logout": key}))


def _groups_changed(sender, instance=None, action="", reverse=False, pk_set=None, **kwargs) -> None:
    if action == "pre_clear" and reverse:
        instance._telemetry_cleared = list(instance.user_set.values_list("pk", flat=True))
        return
    if action not in ("post_remove", "post_clear"):
        return  # joining a team gives access; only leaving takes it away
    if not reverse:
        users = [instance.pk]
    elif action == "post_clear":
        users = getattr(instance, "_telemetry_cleared", [])
    else:
        users = list(pk_set or ())
    _after_commit(lambda: publish.check_user_access(users))


def _group_deleted(sender, instance=None, **kwargs) -> None:
    users = list(instance.user_set.values_list("pk", flat=True))
    _after_commit(lambda: publish.check_user_access(users))


def _user_saved(sender, instance=None, created=False, update_fields=None, **kwargs) -> None:
    if created or (update_fields is not None and set(update_fields) <= {"last_login"}):
        return
    pk = instance.pk
    _after_commit(lambda: publish.check_user_access([pk]))


def _token_saved(sender, instance=None, created=False, **kwargs) -> None:
    if instance.revoked_at is not None:
        h = instance.key_hash
        _after_commit(lambda: publish.close_token_sockets([h]))


def _token_deleted(sender, instance=None, **kwargs) -> None:
    h = instance.key_hash
    _after_commit(lambda: publish.close_token_sockets([h]))


def connect() -> None:
    from apps.inventory.models import PoolToken

    user = get_user_model()
    user_logged_out.connect(_logged_out, dispatch_uid="telemetry-logout")
    m2m_changed.connect(_groups_changed, sender=user.groups.through, dispatch_uid="telemetry-groups")
    pre_delete.connect(_group_deleted, sender=Group, dispatch_uid="telemetry-group-deleted")
    post_save.connect(_user_saved, sender=user, dispatch_uid="telemetry-user-saved")
    post_save.connect(_token_saved, sender=PoolToken, dispatch_uid="telemetry-token-saved")
    post_delete.connect(_token_deleted, sender=PoolToken, dispatch_uid="telemetry-token-deleted")
