"""Per-user API tokens: several named tokens per user, only a hash is stored."""
from __future__ import annotations

import hashlib
import secrets

from django.conf import settings
from django.db import models
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
        tok = (cls.objects.select_related("user")
               .filter(key_hash=cls.hash(raw), revoked_at__isnull=True).first())
        if tok is None or not tok.is_active or not tok.user.is_active:
            return None
        return tok

    def revoke(self) -> None:
        if self.revoked_at is None:
            self.revoked_at = timezone.now()
            self.save(update_fields=["revoked_at"])
