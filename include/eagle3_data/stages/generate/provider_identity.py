"""Who answered: each overflow answer's `model` and `provider` checked against the request's pin.

OpenRouter names the model that served a request by its slug (`moonshotai/kimi-k2.5`, or the
dated `canonical_slug` of the same model) and the provider by its display name ("Moonshot AI"),
while the routing pin (`provider.only`, `provider.order` without fallbacks, `provider.ignore`)
takes provider slugs (`moonshotai`; a variant `deepinfra/turbo` pins one endpoint of `deepinfra`).
So names are compared through OpenRouter's own tables, fetched once before the first request:
`GET {base}/models` (id and canonical_slug of the pinned model) and, when the pin restricts
providers, `GET {base}/providers` (display name -> slug). Never by string equality of the two
spellings, and never by deriving a slug from a name.

An answer from another model or provider is paid for but is not the target's text: its row
fails as `identity_mismatch` (final, never merged) and the gate fails the dataset when such rows
exceed `validation.max_identity_mismatch_rate` (default 0).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from eagle3_data.errors import UserError


def _base(slug: str) -> str:
    return slug.split("/", 1)[0].strip().lower()


def allowed_providers(routing: Mapping[str, Any]) -> tuple[frozenset[str] | None, frozenset[str]]:
    """(slugs an answer may come from, None: any; slugs it may not) from OpenRouter's routing
    object: `only`, else `order` when `allow_fallbacks` is false; `ignore` is always excluded."""
    only, order = routing.get("only"), routing.get("order")
    allowed = only if only else (order if order and routing.get("allow_fallbacks") is False else None)
    return (
        frozenset(_base(s) for s in allowed) if allowed else None,
        frozenset(_base(s) for s in routing.get("ignore") or ()),
    )


@dataclass(frozen=True)
class Pin:
    """What answers must name: the model's accepted names and the provider slugs allowed."""

    model: str
    model_names: frozenset[str]
    providers: frozenset[str] | None = None  # None: any provider
    ignored: frozenset[str] = frozenset()
    slug_of: Mapping[str, str] = field(default_factory=dict)  # provider display name (lowercased) -> slug

    def mismatch(self, answered_model: Any, answered_provider: Any) -> str | None:
        """Why an answer is not from the pin, or None."""
        if answered_model not in self.model_names:
            return (
                f"model: answered by {answered_model!r}, pinned {self.model!r} "
                f"(accepted: {', '.join(sorted(self.model_names))})"
            )
        if self.providers is None and not self.ignored:
            return None
        if not isinstance(answered_provider, str) or not answered_provider:
            return "provider: the answer does not name its provider, and the pin restricts providers"
        slug = self.slug_of.get(answered_provider.strip().lower())
        if slug is None and answered_provider.strip().lower() in set(self.slug_of.values()):
            slug = answered_provider.strip().lower()  # some answers give the slug itself
        if slug is None:
            return f"provider: {answered_provider!r} is not in the provider list ({len(self.slug_of)} names)"
        if _base(slug) in self.ignored or (self.providers is not None and _base(slug) not in self.providers):
            pinned = ", ".join(sorted(self.providers)) if self.providers is not None else "any"
            return f"provider: answered by {answered_provider!r} (slug {slug}), pinned {pinned}" + (
                f", ignoring {', '.join(sorted(self.ignored))}" if self.ignored else ""
            )
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_names": sorted(self.model_names),
            "providers": sorted(self.providers) if self.providers is not None else None,
            "ignored": sorted(self.ignored),
        }


def model_names(pinned: str, listed: Iterable[Mapping[str, Any]], base_url: str) -> frozenset[str]:
    """The pinned model's names in the provider's model list: its id and (OpenRouter) its
    canonical_slug. A pin the list does not have is a config error before any request."""
    for card in listed:
        if isinstance(card, Mapping) and card.get("id") == pinned:
            return frozenset(n for n in (card.get("id"), card.get("canonical_slug")) if isinstance(n, str) and n)
    names: list[str] = sorted(c["id"] for c in listed if isinstance(c, Mapping) and isinstance(c.get("id"), str))
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    raise UserError(
        f"generation.overflow.model {pinned!r} is not a model {base_url} lists at GET /models "
        f"({shown or 'none listed'}): nothing was sent"
    )


def provider_slugs(listed: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Display name (lowercased) -> slug, from `GET /providers`' `data`."""
    return {
        str(p["name"]).strip().lower(): str(p["slug"]).strip().lower()
        for p in listed
        if isinstance(p, Mapping) and p.get("name") and p.get("slug")
    }
