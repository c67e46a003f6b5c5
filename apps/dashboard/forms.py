"""The /jobs/new form, built from the one job-spec schema (trainer.spec.JobSpec), and the
API-token forms.

The Django form only carries the values; the schema validates them (apps.jobs.spec),
so the dashboard shows the same messages as the API and the CLI, each under its field.
"""
from __future__ import annotations

import math
import types
import typing
from datetime import datetime, timedelta
from typing import Any

from annotated_types import Ge, Gt, Le, Lt, MaxLen
from django import forms
from django.utils import timezone

from apps.inventory.models import Pool
from apps.jobs.access import team_names
from apps.jobs.spec import SpecError, validate_spec
from trainer.spec import JobSpec

# Field groups shown as fieldsets; a schema field missing here lands in "Other".
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("Job", ("name", "team", "strategy", "model", "dataset")),
    ("Learners", ("learners", "min_learners", "max_learners", "quorum", "devices_per_learner",
                  "nodes_per_learner", "inner_parallelism")),
    ("Schedule", ("steps", "max_tokens", "inner_steps", "fragments", "fragment_mode",
                  "warmup_steps",
                  "eval_interval", "checkpoint_interval", "max_staleness", "grace_cap_s")),
    ("Optimisation", ("inner_lr", "inner_optimizer", "muon_momentum", "inner_state", "outer_lr",
                      "outer_momentum", "outer_momentum_warmup", "outer_momentum_decay", "weight_decay",
                      "inner_prox", "rda", "final_average",
                      "grad_clip", "batch_size", "seq_len", "seed")),
    ("Placement", ("objective", "compression", "global_compression", "compression_density",
                   "syncer_shards", "pools")),
]


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for `X | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def _label(name: str) -> str:
    words = name.split("_")
    unit = ""
    if words[-1] == "s" and len(words) > 1:
        words, unit = words[:-1], " (s)"
    text = " ".join("LR" if w == "lr" else w for w in words)
    return text[:1].upper() + text[1:] + unit


def _inside(bound, typ: Any, up: bool):
    """The inclusive HTML `min` (up) or `max` for pydantic's exclusive `gt` / `lt` bound: the next
    integer inside it for an int field, the next double inside it for a float field (HTML compares
    doubles, so `max` 0.9999999999999999 refuses 1.0 and nothing below it). The schema still
    validates on the server."""
    if typ is int:
        return int(bound) + 1 if up else int(bound) - 1
    return repr(math.nextafter(float(bound), math.inf if up else -math.inf))


def _field_for(name: str, info, pools: list[Pool]) -> forms.Field:
    typ, optional = _unwrap(info.annotation)
    default = info.get_default(call_default_factory=True)
    attrs: dict[str, Any] = {}
    for m in info.metadata:
        if isinstance(m, Ge):
            attrs["min"] = m.ge
        elif isinstance(m, Gt):
            attrs["min"] = _inside(m.gt, typ, up=True)
        elif isinstance(m, Le):
            attrs["max"] = m.le
        elif isinstance(m, Lt):
            attrs["max"] = _inside(m.lt, typ, up=False)
        elif isinstance(m, MaxLen) and typ is str:
            attrs["maxlength"] = m.max_length
    common = {"label": _label(name), "help_text": info.description or "", "required": False}
    if typing.get_origin(typ) is typing.Literal:
        choices = [(c, c) for c in typing.get_args(typ)]
        return forms.ChoiceField(choices=choices, initial=default, **common)
    if name == "pools":
        return forms.MultipleChoiceField(
            choices=[(p.slug, f"{p.slug} ({p.accelerator}, {p.get_state_display().lower()})") for p in pools],
            widget=forms.CheckboxSelectMultiple, initial=default,
            **{**common, "help_text": "leave all unticked to let the platform choose"},
        )
    if typ is bool:
        return forms.BooleanField(initial=default, **common)
    if typ in (int, float):
        attrs["step"] = "1" if typ is int else "any"
        widget = forms.NumberInput(attrs=attrs)
    else:
        widget = forms.TextInput(attrs=attrs)
    field = forms.CharField(widget=widget, initial=None if optional else default, strip=True, **common)
    field.optional_in_schema = optional
    if optional:
        field.help_text = (field.help_text + " (optional)").strip()
    return field


class JobSpecForm(forms.Form):
    """Fields generated from JobSpec; clean() runs the shared validation."""

    def __init__(self, *args, user=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.pools = list(Pool.objects.select_related("accelerator").order_by("slug"))
        for name, info in JobSpec.model_fields.items():
            self.fields[name] = _field_for(name, info, self.pools)
        teams = team_names(user) if user is not None else []
        if teams:  # not part of the spec: who besides the owner sees the job
            self.fields["team"] = forms.ChoiceField(
                choices=[("", "none (only you)")] + [(t, t) for t in sorted(teams)], required=False,
                label="Team", help_text="members of this team see and act on the job too")
        self.spec: JobSpec | None = None

    @classmethod
    def unchecked(cls, data, user=None) -> JobSpecForm:
        """An unbound form showing `data` again, without validating it (a throttled request:
        validation and the dry run are the work being limited)."""
        form = cls(user=user)
        form.initial = {name: data.getlist(name) if isinstance(field, forms.MultipleChoiceField)
                        else data.get(name) for name, field in form.fields.items() if name in data}
        return form

    def fieldsets(self) -> list[tuple[str, list[forms.BoundField]]]:
        seen: set[str] = set()
        out = []
        for title, names in GROUPS:
            present = [n for n in names if n in self.fields]
            seen.update(present)
            out.append((title, [self[n] for n in present]))
        rest = [self[n] for n in self.fields if n not in seen]
        if rest:
            out.append(("Other", rest))
        return out

    def spec_data(self) -> dict[str, Any]:
        """The raw values as the schema expects them (strings for numbers: pydantic parses)."""
        data: dict[str, Any] = {}
        for name, field in self.fields.items():
            if name not in JobSpec.model_fields:
                continue
            value = self.cleaned_data.get(name)
            if isinstance(field, forms.MultipleChoiceField):
                data[name] = list(value or [])
            elif value in (None, ""):
                if getattr(field, "optional_in_schema", False):
                    data[name] = None
                else:
                    self.add_error(name, "This field is required.")
            else:
                data[name] = value
        return data

    def clean(self):
        cleaned = super().clean()
        data = self.spec_data()
        if self.errors:
            return cleaned
        try:
            self.spec = validate_spec(data)
        except SpecError as exc:
            for field, messages in exc.errors.items():
                target = field.split(".")[0]
                for msg in messages:
                    self.add_error(target if target in self.fields else None, msg)
        return cleaned


_DAYS_ERROR = "Expiry must be a number of days between 1 and 3650, or empty for none."


class TokenCreateForm(forms.Form):
    """A new personal API token; the issuing rules (cap, expiry) are apps.api.authentication's."""

    name = forms.CharField(max_length=60, error_messages={
        "required": "Give the token a name of 1 to 60 characters.",
        "max_length": "Give the token a name of 1 to 60 characters."})
    days = forms.IntegerField(min_value=1, max_value=3650, required=False, error_messages=dict.fromkeys(
        ("invalid", "min_value", "max_value"), _DAYS_ERROR))

    def expires_at(self) -> datetime | None:
        days = self.cleaned_data.get("days")
        return timezone.now() + timedelta(days=days) if days else None


class TokenRevokeForm(forms.Form):
    """Which token to revoke: a row id (bounded, so a huge number is an error, not a database one)."""

    token = forms.IntegerField(min_value=1, max_value=2**63 - 1)
