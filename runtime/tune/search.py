"""The search of `runtime tune`, a pure function of a `measure(setting, rate, num_prompts)` callable.

Goodput of a setting (DistServe's measure): the highest request rate (req/s, Poisson arrivals)
at which at least `attainment` of the requests meet every SLO term. `find_goodput` finds it for
one setting:

1. from scratch, one run at rate inf (all requests at once) gives the setting's maximum
   throughput T. When even that run meets the attainment, the setting serves any rate it can
   keep up with: goodput = T (`saturated`). Otherwise `steps` probes bisect (0, 2 T), the first
   one at T: a rate far above T builds a queue that never drains, but T itself understates
   what Poisson arrivals can be served at (its all-at-once run has prefill-heavy steps and
   ends with a tail of a few long requests), so rates up to 2 T are tried;
2. given the evaluation of an earlier round (`prior`), no rate-inf run, and either
   - `inherit`: its bracket is kept and `steps` probes go on bisecting it (a continued
     bisection at more prompts), or
   - not: nothing earlier is trusted; the first probe goes to the middle of the earlier
     bracket, the next ones step outward from it by a doubling spread (half that bracket's
     width) until the verdict flips (bracketing, within (0, 2 T)), and the probes left
     bisect the bracket found.

Goodput is the highest rate that passed (0 when none did); the bracket is (that rate, the lowest
rate that failed).

`successive_halving` spends the runs where the answer is. Round 0 evaluates every setting
cheaply: few prompts, the rate-inf run and one probe (does it sustain its all-at-once
throughput?). The better half goes on to the next round with twice the prompts and one more
bisection step of its inherited bracket, and so on until two settings are left; that last round
re-brackets them from scratch around their brackets at the full `num_prompts` with `steps`
probes, and its winner is the answer. A grid of S settings so costs about 3 S + 2 steps runs
(and far fewer requests), against S (1 + steps) for a full-precision bisection of every setting
(`full_grid_runs`). Everything here is deterministic given the measurements;
runtime/tune/runner.py supplies the real `measure` (a server per setting and round).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slimserve.runtime.serve_options import serve_default, tune_settings

# serve's option names of the settings searched: those marked `tune` in runtime/serve_options.py,
# in table order (= Setting's fields; tests/runtime/test_serve_options.py checks the two agree)
SETTING_KEYS = tune_settings()


@dataclass(frozen=True, slots=True, order=True)
class Setting:
    """One point of the search space; the fields are `runtime serve` options of the same name
    (SETTING_KEYS), defaulting to serve's defaults."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str = serve_default("kv_cache_dtype")
    enable_prefix_caching: bool = serve_default("enable_prefix_caching")

    def flags(self) -> dict[str, Any]:
        """serve option name -> value (what the YAML file and the served command get)."""
        return {k: getattr(self, k) for k in SETTING_KEYS}

    @property
    def label(self) -> str:
        """max_num_seqs/max_num_batched_tokens, then what differs from serve's defaults."""
        kv = "" if self.kv_cache_dtype == "auto" else f" kv {self.kv_cache_dtype}"
        return (
            f"{self.max_num_seqs}/{self.max_num_batched_tokens}{kv}"
            f"{'' if self.enable_prefix_caching else ' no-prefix-cache'}"
        )


Metrics = Mapping[str, Any]  # at least "attainment" (0..1) and "request_throughput" (req/s)
Measure = Callable[[Setting, float, int], Metrics]


@dataclass(slots=True)
class Probe:
    """One benchmark run."""

    setting: Setting
    round: int
    rate: float  # Poisson request rate, req/s (inf: all at once)
    num_prompts: int
    attainment: float  # fraction of the requests that met every SLO term
    passed: bool  # attainment >= the target
    metrics: Metrics  # what measure returned


@dataclass(slots=True)
class Evaluation:
    """A setting's goodput from one round."""

    setting: Setting
    round: int
    num_prompts: int
    steps: int  # probes at finite rates
    max_throughput: float  # request throughput of the rate-inf run (round 0's after it), req/s
    goodput: float  # highest passing rate, req/s (max_throughput when saturated; 0: none passed)
    bracket: tuple[float, float]  # (highest passing rate or 0, lowest failing rate or the cap)
    saturated: bool  # the rate-inf run met the attainment
    probes: list[Probe] = field(default_factory=list)

    @property
    def runs(self) -> int:
        return len(self.probes)

    @property
    def best_probe(self) -> Probe | None:
        """The run at the goodput rate (the rate-inf run when saturated)."""
        passed = [p for p in self.probes if p.passed]
        return max(passed, key=lambda p: p.rate) if passed else None


@dataclass(frozen=True, slots=True)
class Round:
    """Plan of one round of successive halving."""

    settings: int  # how many settings it evaluates
    num_prompts: int
    steps: int


@dataclass(slots=True)
class SearchResult:
    rounds: list[list[Evaluation]]  # per round, the evaluations ranked best first
    plan: list[Round]

    @property
    def best(self) -> Evaluation:
        return self.rounds[-1][0]

    @property
    def runs(self) -> int:
        return sum(e.runs for r in self.rounds for e in r)

    @property
    def evaluations(self) -> list[Evaluation]:
        return [e for r in self.rounds for e in r]


def plan_rounds(
    n_settings: int, num_prompts: int, steps: int, min_prompts: int = 8, first_steps: int = 1
) -> list[Round]:
    """Successive halving's rounds: the settings left, prompts per run and probes of each. The
    last round (two settings, or the only one) gets num_prompts and steps; each earlier round
    half the prompts of the next (at least min_prompts) and `first_steps` probes (round 0 after
    its rate-inf run)."""
    if n_settings < 1:
        raise ValueError("the search space is empty")
    counts = [n_settings]
    while counts[-1] > 2:
        counts.append(math.ceil(counts[-1] / 2))
    last = len(counts) - 1
    return [
        Round(
            c,
            max(min(min_prompts, num_prompts), num_prompts >> (last - i)),
            steps if i == last else min(steps, first_steps),
        )
        for i, c in enumerate(counts)
    ]


def full_grid_runs(n_settings: int, steps: int) -> int:
    """Runs a plain grid search at full precision would take (a rate-inf run + steps each)."""
    return n_settings * (1 + steps)


def expected_runs(plan: Sequence[Round]) -> int:
    """Runs the plan takes at most (a saturated setting takes one per round)."""
    return sum(r.settings * (r.steps + (i == 0)) for i, r in enumerate(plan))


def _probe(
    measure: Measure,
    setting: Setting,
    rate: float,
    n: int,
    target: float,
    rnd: int,
    on_probe: Callable[[Probe], None] | None,
) -> Probe:
    m = measure(setting, rate, n)
    att = float(m["attainment"])
    p = Probe(setting, rnd, rate, n, att, att >= target, m)
    if on_probe is not None:
        on_probe(p)
    return p


def find_goodput(
    measure: Measure,
    setting: Setting,
    *,
    num_prompts: int,
    target: float,
    steps: int,
    prior: Evaluation | None = None,
    inherit: bool = False,
    round_: int = 0,
    on_probe: Callable[[Probe], None] | None = None,
    max_probe_s: float | None = None,
) -> Evaluation:
    """The setting's goodput (module docstring): from scratch, a rate-inf run and `steps`
    bisection probes; after an earlier round's evaluation `prior`, `steps` probes that go on
    bisecting its bracket (`inherit`) or bracket anew around it. `max_probe_s`: no probe runs
    slower than num_prompts / max_probe_s req/s (its arrivals alone would take longer); a
    setting that misses the SLO even there has goodput 0 (bracket (0, that rate))."""
    if not 0 < target <= 1:
        raise ValueError(f"attainment {target} must be in (0, 1]")
    probes: list[Probe] = []
    if prior is None or prior.saturated:
        first = _probe(measure, setting, math.inf, num_prompts, target, round_, on_probe)
        probes.append(first)
        top = float(first.metrics["request_throughput"])
        if first.passed or top <= 0:
            good = top if first.passed else 0.0
            return Evaluation(
                setting, round_, num_prompts, 0, top, good, (good, good), first.passed, probes
            )
        lo, hi, guess, spread = 0.0, 2 * top, None, 0.0
    else:
        top = prior.max_throughput
        if top <= 0:  # every request failed before: nothing to probe
            return Evaluation(setting, round_, num_prompts, 0, top, 0.0, (0.0, 0.0), False, [])
        lo, hi = prior.bracket if inherit else (0.0, 2 * top)
        guess = None if inherit else sum(prior.bracket) / 2
        spread = max((prior.bracket[1] - prior.bracket[0]) / 2, top / 2 ** (steps + 2))
    left = steps
    floor = num_prompts / max_probe_s if max_probe_s else 0.0

    def run(rate: float) -> bool:
        nonlocal lo, hi, left
        rate = max(rate, floor)
        p = _probe(measure, setting, rate, num_prompts, target, round_, on_probe)
        probes.append(p)
        left -= 1
        if p.passed:
            lo = max(lo, rate)
        else:
            hi = min(hi, rate)
        return p.passed

    if guess is not None and lo < guess < hi and left > 0:
        up = run(guess)
        rate = guess
        while left > 0:  # walk away from the guess until the verdict flips: a bracket
            rate = max(rate + spread if up else rate - spread, floor)
            if not lo < rate < hi or run(rate) != up:
                break
            spread *= 2
    while left > 0 and hi > floor:  # the floor failed: nothing slower is probed
        run((lo + hi) / 2)
    return Evaluation(
        setting,
        round_,
        num_prompts,
        sum(math.isfinite(p.rate) for p in probes),
        top,
        lo,
        (lo, hi),
        False,
        probes,
    )


def rank(evaluations: Sequence[Evaluation]) -> list[Evaluation]:
    """Best first: goodput, then maximum throughput, then the setting's grid order."""
    return sorted(evaluations, key=lambda e: (-e.goodput, -e.max_throughput, e.setting))


def successive_halving(
    measure: Measure,
    settings: Sequence[Setting],
    *,
    target: float,
    num_prompts: int,
    steps: int,
    min_prompts: int = 8,
    first_steps: int = 1,
    on_probe: Callable[[Probe], None] | None = None,
    on_round: Callable[[int, Round, list[Setting]], None] | None = None,
    max_probe_s: float | None = None,
) -> SearchResult:
    """Evaluate every setting cheaply, keep the better half with more prompts and a finer
    bracket, until the last round re-brackets two at full precision (module docstring)."""
    if not settings:
        raise ValueError("the search space is empty")
    if len(set(settings)) != len(settings):
        raise ValueError("the search space lists a setting twice")
    plan = plan_rounds(len(settings), num_prompts, steps, min_prompts, first_steps)
    alive, previous = list(settings), {}
    rounds: list[list[Evaluation]] = []
    for i, rnd in enumerate(plan):
        alive = alive[: rnd.settings]
        if on_round is not None:
            on_round(i, rnd, alive)
        ranked = rank(
            [
                find_goodput(
                    measure,
                    s,
                    num_prompts=rnd.num_prompts,
                    target=target,
                    steps=rnd.steps,
                    prior=previous.get(s),
                    inherit=i < len(plan) - 1,
                    round_=i,
                    on_probe=on_probe,
                    max_probe_s=max_probe_s,
                )
                for s in alive
            ]
        )
        rounds.append(ranked)
        previous = {e.setting: e for e in ranked}
        alive = [e.setting for e in ranked]
    return SearchResult(rounds, plan)
