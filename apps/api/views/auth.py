"""Personal API tokens: sign in with username/password for a token; list and revoke your tokens."""
from __future__ import annotations

from datetime import timedelta

from django.contrib.auth import authenticate
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.exceptions import AuthenticationFailed, ValidationError
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from .. import serializers as s
from ..authentication import ApiTokenAuthentication, TokenRefused, issue_token
from ..models import ApiToken
from ..permissions import IsPerson
from ..throttling import AUTH_THROTTLES, TOKEN_CREATE_THROTTLES

# The token endpoints take a username, a password, a name and a number: a larger body is refused
# before it is decoded (apps/api/parsers.py), whatever it holds.
TOKEN_BODY_MAX_BYTES = 4096


def _issue(user, data, minted_by: ApiToken | None = None) -> Response:
    """A new token under the shared rules (apps.api.authentication.issue_token)."""
    days = data.get("expires_in_days")
    expires = timezone.now() + timedelta(days=days) if days else None
    try:
        tok, raw = issue_token(user, data.get("name") or "cli", expires_at=expires, minted_by=minted_by)
    except TokenRefused as exc:
        raise ValidationError({"name": [str(exc)]}) from None
    tok.token = raw
    return Response(s.ApiTokenCreatedSerializer(tok).data, status=status.HTTP_201_CREATED)


class ObtainTokenView(APIView):
    """Exchange a username and password for a new personal API token (rate limited)."""

    authentication_classes = [ApiTokenAuthentication]
    permission_classes = [AllowAny]
    throttle_classes = list(AUTH_THROTTLES)
    max_body_bytes = TOKEN_BODY_MAX_BYTES

    @extend_schema(request=s.TokenCreateSerializer,
                   responses={201: s.ApiTokenCreatedSerializer, 400: OpenApiTypes.OBJECT,
                              401: OpenApiTypes.OBJECT})
    def post(self, request):
        ser = s.TokenCreateSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        data = ser.validated_data
        missing = {f: ["This field is required."] for f in ("username", "password") if not data.get(f)}
        if missing:
            raise ValidationError(missing)
        user = authenticate(request, username=data["username"], password=data["password"])
        if user is None or not user.is_active:
            raise AuthenticationFailed("Unable to sign in with these credentials.")
        return _issue(user, data)


class ApiTokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                      viewsets.GenericViewSet):
    """Your API tokens. POST creates one (signed in: session or token), DELETE revokes it."""

    serializer_class = s.ApiTokenSerializer
    permission_classes = [IsPerson]
    throttle_classes = list(TOKEN_CREATE_THROTTLES)  # counts POSTs only
    max_body_bytes = TOKEN_BODY_MAX_BYTES
    pagination_class = None
    lookup_value_regex = r"[0-9]+"

    def get_queryset(self):
        qs = ApiToken.objects.filter(user=self.request.user)
        if self.action == "list" and self.request.query_params.get("all") != "1":
            qs = qs.filter(revoked_at__isnull=True)
        return qs

    @extend_schema(request=s.TokenCreateSerializer, responses={201: s.ApiTokenCreatedSerializer})
    def create(self, request):
        """Signed in with a token, the new one expires no later than it (capped, see expires_at)."""
        ser = s.TokenCreateSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        if ser.validated_data.get("username") or ser.validated_data.get("password"):
            raise ValidationError({"password": ["Not used here: you are signed in already."]})
        minted_by = request.auth if isinstance(request.auth, ApiToken) else None
        return _issue(request.user, ser.validated_data, minted_by=minted_by)

    def perform_destroy(self, instance):
        instance.revoke()


class MeView(APIView):
    """Who the credentials belong to."""

    permission_classes = [IsPerson]

    @extend_schema(responses=s.MeSerializer)
    def get(self, request):
        return Response(s.MeSerializer(request.user).data)
