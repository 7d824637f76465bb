"""The settings of rollout correction, parsed and checked once: verl's `rollout_correction`
keys (`verl/trainer/config/algorithm.py`) as a frozen, hashable `RolloutCorrection`.

This module imports no jax: the config validates its keys with `RolloutCorrection.parse`
(reading a config must not load jax), and `rollout_corr` takes the parsed values as static
arguments of its jitted maths.

Threshold specs, as verl writes them:
- `rollout_is_threshold`: a number (TIS: weights clamped to it) or `"lower_upper"` (IcePop:
  weights outside `[lower, upper]` set to 0).
- `rollout_rs_threshold`: one spec per `rollout_rs` option, comma-separated (one spec is
  shared by all options). A `*_k1` option takes `"lower_upper"`, or one number `u` meaning
  `"1/u_u"`; the k2 / k3 options take one positive upper bound.
"""

from __future__ import annotations

import dataclasses

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
LOSS_TYPES = ("ppo_clip", "reinforce")


class SpecError(ValueError):
    """A bad rollout-correction setting; `key` names it (e.g. `rollout_rs_threshold`)."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


@dataclasses.dataclass(frozen=True)
class RSOption:
    """One rejection criterion: `name` (one of `ROLLOUT_RS_OPTIONS`) and its bounds; `lower`
    is set for the `*_k1` options only (a ratio bound, as `upper` is there)."""

    name: str
    upper: float
    lower: float | None = None

    @property
    def level(self) -> str:
        return "token" if self.name.startswith("token_") else "sequence"

    @property
    def estimator(self) -> str:
        return self.name.rsplit("_", 1)[1]  # k1 | k2 | k3

    @property
    def reduce(self) -> str:
        return "token" if self.level == "token" else self.name.split("_")[1]  # sum|mean|max


def _number(text: str, key: str, spec: object) -> float:
    try:
        return float(text)
    except ValueError:
        raise SpecError(key, f"invalid threshold {spec!r} (expected a number or "
                             "'lower_upper')") from None


def parse_rollout_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """`(upper, lower)` of `rollout_is_threshold`; lower is None for TIS (one number).

    Raises:
      SpecError: not a number / `"lower_upper"`, a bound <= 0, or lower > upper.
    """
    key = "rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise SpecError(key, f"expected a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    if not text:
        raise SpecError(key, "must not be empty")
    if "_" in text:
        low, high = text.split("_", 1)
        lower, upper = _number(low, key, spec), _number(high, key, spec)
    else:
        lower, upper = None, _number(text, key, spec)
    if not upper > 0:
        raise SpecError(key, f"the upper bound must be > 0, got {upper}")
    if lower is not None and not lower > 0:
        raise SpecError(key, f"the lower bound must be > 0, got {lower}")
    if lower is not None and lower > upper:
        raise SpecError(key, f"the lower bound {lower} is above the upper bound {upper}")
    return upper, lower


def parse_rollout_rs(rollout_rs: str | None,
                     rollout_rs_threshold: str | float | None) -> tuple[RSOption, ...]:
    """The rejection criteria of `rollout_rs` (comma-separated, duplicates dropped, order
    kept) with their bounds from `rollout_rs_threshold`; `()` when `rollout_rs` is None.

    Raises:
      SpecError: an unknown option, a missing or malformed threshold, a count of thresholds
        other than 1 or the number of options.
    """
    if rollout_rs is None:
        return ()
    names: list[str] = []
    for name in (s.strip() for s in str(rollout_rs).split(",")):
        if name and name not in ROLLOUT_RS_OPTIONS:
            raise SpecError("rollout_rs", f"{name!r} is not one of {', '.join(ROLLOUT_RS_OPTIONS)}")
        if name and name not in names:
            names.append(name)
    if not names:
        raise SpecError("rollout_rs", "names no option (use null to turn rejection off)")
    key = "rollout_rs_threshold"
    if rollout_rs_threshold is None:
        raise SpecError(key, f"is required when rollout_rs is set (got rollout_rs={rollout_rs!r})")
    if isinstance(rollout_rs_threshold, bool):
        raise SpecError(key, "expected numbers or 'lower_upper' strings, got "
                             f"{rollout_rs_threshold}")
    specs = [s.strip() for s in str(rollout_rs_threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise SpecError(key, f"{len(specs)} thresholds for {len(names)} rollout_rs options "
                             "(give one shared threshold or one per option)")
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for name, spec in zip(names, specs, strict=True):
        if name.endswith("k1"):
            if "_" in spec:
                low, high = spec.split("_", 1)
                lower, upper = _number(low, key, spec), _number(high, key, spec)
            else:
                upper = _number(spec, key, spec)
                lower = 1.0 / upper if upper > 0 else upper
            if not (lower > 0 and upper > 0):
                raise SpecError(key, f"{name}: bounds must be > 0, got {spec!r}")
            if lower > upper:
                raise SpecError(key, f"{name}: lower bound above upper bound in {spec!r}")
            out.append(RSOption(name, upper, lower))
        else:
            if "_" in spec:
                raise SpecError(key, f"{name} takes one upper bound, not 'lower_upper' "
                                     f"(got {spec!r})")
            upper = _number(spec, key, spec)
            if not upper > 0:
                raise SpecError(key, f"{name}: the bound must be > 0, got {spec!r}")
            out.append(RSOption(name, upper))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """Parsed `algorithm.rollout_correction`: hashable, so jitted functions take it static.

    rollout_is: None (weights off: diagnostics only), "token" or "sequence".
    is_upper, is_lower: the IS bounds (`is_lower` None: TIS clamp; set: IcePop).
    batch_normalize: rescale the IS weights to mean 1 over the batch.
    rs: the rejection criteria (all must pass), `()` for none.
    bypass_mode: PPO's old log-probs are the rollout's; correction happens in the loss.
    loss_type: bypass mode's loss, "ppo_clip" or "reinforce".
    """

    rollout_is: str | None = None
    is_upper: float = 2.0
    is_lower: float | None = None
    batch_normalize: bool = False
    rs: tuple[RSOption, ...] = ()
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    @classmethod
    def parse(cls, rollout_is: str | None = None, rollout_is_threshold: str | float = 2.0,
              rollout_is_batch_normalize: bool = False, rollout_rs: str | None = None,
              rollout_rs_threshold: str | float | None = None, bypass_mode: bool = False,
              loss_type: str = "ppo_clip") -> RolloutCorrection:
        """From verl's keys and values (see the module docstring); raises SpecError."""
        if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
            raise SpecError("rollout_is", f"{rollout_is!r} is not one of "
                                          f"{', '.join(ROLLOUT_IS_LEVELS)} (or null)")
        if loss_type not in LOSS_TYPES:
            raise SpecError("loss_type", f"{loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
        return cls(rollout_is, upper, lower, bool(rollout_is_batch_normalize),
                   parse_rollout_rs(rollout_rs, rollout_rs_threshold), bool(bypass_mode),
                   loss_type)

    @classmethod
    def from_config(cls, section) -> RolloutCorrection:
        """From the `algorithm.rollout_correction` config section."""
        return cls.parse(**{f.name: getattr(section, f.name)
                            for f in dataclasses.fields(section)})
