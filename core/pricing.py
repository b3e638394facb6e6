"""Money in exact integer nano-units, and the one cost formula.

Prices are per million tokens with at most six decimal places, so in nano-units of their
currency (1e-9) they are exact integers, and so is everything priced from them: Redis
counts money with integer arithmetic, PostgreSQL keeps it as decimals with nine places.

``cost_nano`` is the only place a request is priced: the gateway's admission estimate
and settlement, the orphan reaper, the stored cost of a usage event (metering) and the
playground's figure all call it, rounding up to the nano-unit (never under-billing); the
FOCUS export splits a billed line into its token kinds with it, rounding half to even.
"""

from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Protocol

NANO = Decimal("1e9")  # nano-units per unit of currency
PRICE_TOKENS = 1_000_000  # prices are per this many tokens


class NanoRates(Protocol):
    """A price version's rates in nano-units per 1M tokens."""

    input_nano_per_mtok: int
    cached_nano_per_mtok: int
    output_nano_per_mtok: int


@dataclass(frozen=True, slots=True)
class Rates:
    """Rates in nano-units per 1M tokens (a ``NanoRates``)."""

    input_nano_per_mtok: int
    cached_nano_per_mtok: int
    output_nano_per_mtok: int

    @classmethod
    def of(
        cls,
        input_per_mtok: Decimal | None,
        cached_per_mtok: Decimal | None,
        output_per_mtok: Decimal | None,
    ) -> "Rates":
        """From decimal prices per 1M tokens; None (no price) counts as 0."""
        return cls(
            _nano_or_zero(input_per_mtok),
            _nano_or_zero(cached_per_mtok),
            _nano_or_zero(output_per_mtok),
        )


def cost_nano(
    rates: NanoRates, prompt: int, cached: int, completion: int, half_even: bool = False
) -> int:
    """What ``prompt`` tokens (``cached`` of them at the cached rate) and ``completion``
    tokens cost, in nano-units, rounded up; ``half_even`` rounds half to even instead.
    An admission estimate has no cached tokens."""
    uncached = prompt - cached if prompt > cached else 0
    scaled = (
        uncached * rates.input_nano_per_mtok
        + cached * rates.cached_nano_per_mtok
        + completion * rates.output_nano_per_mtok
    )
    if half_even:
        units, rest = divmod(scaled, PRICE_TOKENS)
        up = 2 * rest > PRICE_TOKENS or (2 * rest == PRICE_TOKENS and units % 2 == 1)
        return units + 1 if up else units
    return -(-scaled // PRICE_TOKENS)


def to_nano(amount: Decimal) -> int:
    """An amount of money as integer nano-units (rounded up: never under-bill)."""
    return int((amount * NANO).to_integral_value(rounding=ROUND_CEILING))


def from_nano(units: int) -> Decimal:
    """Integer nano-units as a decimal amount with nine places."""
    return Decimal(units) / NANO


def _nano_or_zero(amount: Decimal | None) -> int:
    return to_nano(amount) if amount is not None else 0
