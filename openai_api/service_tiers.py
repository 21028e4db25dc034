"""OpenAI's ``service_tier`` on tierflow's tiers.

The tier of a request is the one the gateway set from its API key (``x-tierflow-tier``); a
request's ``service_tier`` may ask for that tier or a lower one (a higher rank), never a higher
one (403). ``auto`` (or no value) is the key's own tier. OpenAI's names map onto tier names
(default: ``priority`` -> critical, ``default`` -> standard, ``flex`` -> batch); tier names are
accepted as they are too. The response names the tier that served the request in OpenAI's terms
where it has a name there, else by its tierflow name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from openai_api.errors import OpenAIError, bad_request
from tierflow.tiers import TierTable

DEFAULT_SERVICE_TIERS: Mapping[str, str] = MappingProxyType(
    {"priority": "critical", "default": "standard", "flex": "batch"}
)
AUTO = "auto"


@dataclass(frozen=True)
class ServiceTiers:
    tiers: TierTable
    names: Mapping[str, str] = field(default_factory=lambda: DEFAULT_SERVICE_TIERS)  # -> tier

    def __post_init__(self) -> None:
        for openai_name, tier in self.names.items():
            if tier not in self.tiers:
                raise ValueError(
                    f"service_tier {openai_name!r} maps to {tier!r}, which is not in the tier "
                    f"table (tiers: {', '.join(self.tiers.names)})"
                )

    def resolve(self, key_tier: str | None, requested: str | None) -> str:
        """The tier to serve a request with: the key's, or the lower one it asked for."""
        if not key_tier:
            raise OpenAIError(
                401,
                "no tier for this request: send your API key as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if key_tier not in self.tiers:
            raise OpenAIError(403, f"tier {key_tier!r} is not served here", code="tier_unknown")
        if requested is None or requested == AUTO:
            return key_tier
        tier = self.names.get(requested, requested)
        if tier not in self.tiers:
            offered = ", ".join([AUTO, *self.names, *self.tiers.names])
            raise bad_request(
                f"unknown service_tier {requested!r}; one of: {offered}", param="service_tier"
            )
        if self.tiers[tier].rank < self.tiers[key_tier].rank:
            raise OpenAIError(
                403,
                f"service_tier {requested!r} (tier {tier}) is above this API key's tier "
                f"({key_tier}); use {self.openai_name(key_tier)!r} or lower",
                code="tier_not_allowed",
                param="service_tier",
            )
        return tier

    def openai_name(self, tier: str) -> str:
        """What the response's ``service_tier`` says for ``tier``."""
        for openai_name, mapped in self.names.items():
            if mapped == tier:
                return openai_name
        return tier
