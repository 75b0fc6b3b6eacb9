"""Seeded workload generators: arrival processes, length distributions, shared prefixes,
multi-turn conversations and priority classes, producing trace requests.

Distributions are written ``NAME:key=value,...`` (a bare value is the first parameter):

    fixed:128                       every draw is 128
    uniform:low=64,high=512         integers in [low, high]
    normal:mean=1000,std=200
    lognormal:mean=1000,sigma=0.6   ln X ~ N(mu, sigma) with E[X] = mean
    zipf:a=2.5,scale=64             scale * K, P(K = k) ~ k^-a (a <= 2: no finite mean)
  each also takes min=,max= to clip (defaults: 1 and unbounded); a fixed value below the
  minimum is an error, not clipped up.

Draw order (fixed, so a seed reproduces a trace), from one ``numpy.random.default_rng(seed)``:
the start gaps of num_requests conversations; one prefix length per prefix group; then per
conversation: its turn count, the new-text and output lengths of its turns, their think
times (if think_time > 0), its prefix group and whether it uses it (if prefix_groups > 0),
its priority class. Single-turn conversations are plain requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvserve.sim.trace import MAX_TIME, TraceRequest


class WorkloadError(ValueError):
    """A bad generator parameter."""


_DIST_PARAMS: dict[str, tuple[str, ...]] = {
    "fixed": ("value",),
    "uniform": ("low", "high"),
    "normal": ("mean", "std"),
    "lognormal": ("mean", "sigma"),
    "zipf": ("a", "scale"),
}
_DIST_DEFAULTS: dict[str, dict[str, float]] = {
    "lognormal": {"sigma": 0.5}, "zipf": {"scale": 1.0}, "normal": {"std": 0.0},
}


@dataclass(frozen=True)
class LengthDist:
    kind: str
    params: dict[str, float]
    low: int = 1
    high: int | None = None

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        kind, _, rest = text.partition(":")
        kind = kind.strip()
        if kind not in _DIST_PARAMS:
            raise WorkloadError(f"unknown distribution {kind!r} in {text!r}; known: "
                                f"{', '.join(_DIST_PARAMS)}")
        names = _DIST_PARAMS[kind]
        params: dict[str, float] = dict(_DIST_DEFAULTS.get(kind, {}))
        clip: dict[str, int] = {}
        given: set[str] = set()
        for index, item in enumerate(p for p in rest.split(",") if p.strip()):
            key, eq, value = item.partition("=")
            if not eq:
                if index >= len(names):
                    raise WorkloadError(f"{text!r}: {kind} takes {len(names)} bare value(s) "
                                        f"({', '.join(names)}); write the others as min=... "
                                        "or max=...")
                key, value = names[index], item
            key = key.strip()
            if key in given:  # QA (CLI fuzz): the last one won, silently
                raise WorkloadError(f"{text!r}: {key} is given twice")
            given.add(key)
            try:
                number = float(value)
            except ValueError:
                raise WorkloadError(f"{text!r}: {key}={value!r} is not a number") from None
            if not math.isfinite(number):
                raise WorkloadError(f"{text!r}: {key}={value!r} is not a finite number")
            if key in ("min", "max"):
                clip[key] = int(number)
            elif key in names:
                params[key] = number
            else:
                raise WorkloadError(f"{text!r}: unknown parameter {key!r} for {kind}; "
                                    f"known: {', '.join((*names, 'min', 'max'))}")
        missing = [n for n in names if n not in params]
        if missing:
            raise WorkloadError(f"{text!r}: missing {', '.join(missing)}")
        dist = cls(kind, params, clip.get("min", 1), clip.get("max"))
        dist._validate(text)
        return dist

    def _validate(self, text: str) -> None:
        p = self.params
        lengths = [v for k, v in p.items() if k not in ("a", "sigma")]  # not shape terms
        if not all(math.isfinite(v) for v in p.values()) or \
                any(v > MAX_LENGTH for v in lengths) or self.low > MAX_LENGTH or \
                (self.high is not None and self.high > MAX_LENGTH):
            raise WorkloadError(f"{text!r}: lengths are at most {MAX_LENGTH:.0e} tokens")
        bad = (
            (self.kind == "fixed" and p["value"] < 0)
            or (self.kind == "uniform" and not 0 <= p["low"] <= p["high"])
            or (self.kind == "normal" and (p["mean"] < 0 or p["std"] < 0))
            or (self.kind == "lognormal" and (p["mean"] <= 0 or p["sigma"] < 0))
            or (self.kind == "zipf" and (p["a"] <= 1 or p["scale"] <= 0))
            or self.low < 0 or (self.high is not None and self.high < self.low)
        )
        if bad:
            raise WorkloadError(f"{text!r}: parameters out of range (lengths are >= 0, "
                                "uniform needs low <= high, lognormal mean > 0, zipf a > 1)")
        if self.kind == "fixed" and p["value"] < self.low:  # not silently clipped up
            raise WorkloadError(f"{text!r}: {p['value']:g} is below the draws' minimum "
                                f"{self.low:g} (min=... lowers it)")

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        p = self.params
        if self.kind == "fixed":
            raw = np.full(size, p["value"])
        elif self.kind == "uniform":
            raw = rng.integers(int(p["low"]), int(p["high"]), size, endpoint=True)
        elif self.kind == "normal":
            raw = rng.normal(p["mean"], p["std"], size)
        elif self.kind == "lognormal":
            sigma = p["sigma"]
            raw = rng.lognormal(math.log(p["mean"]) - sigma * sigma / 2, sigma, size)
        else:
            raw = p["scale"] * rng.zipf(p["a"], size)
        # A heavy tail (zipf, a wide lognormal) draws past any length a trace may hold:
        # clipped to MAX_LENGTH, as a length written past it is refused (a zipf draw was
        # 365 billion tokens).
        values = np.rint(np.minimum(raw, MAX_LENGTH)).astype(np.int64)
        return np.clip(values, self.low, self.high if self.high is not None else None)


ARRIVALS = ("poisson", "gamma", "burst")
CONVERSATION = "conv"  # a multi-turn conversation's prefix and session id: conv<N>


def is_turn(request: TraceRequest) -> bool:
    """Whether a generated request is a turn of a multi-turn conversation."""
    return request.prefix_id is not None and request.prefix_id.startswith(CONVERSATION)


MAX_LENGTH = 1e9  # tokens: a length beyond it is a typo (and past numpy's integer draws)


# A trace's requests: generated in memory at about 650 bytes each, so 10^7 take some 7 GB
# (the CLI pass: the 10^8 this allowed needed 65 GB, and the OOM killer ended it silently)
MAX_REQUESTS = 10_000_000
MIN_CV, MAX_CV = 1e-3, 1e3  # gamma arrivals' coefficient of variation


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 100
    rate: float = 1.0  # requests (conversation starts) per second, on average
    arrival: str = "poisson"
    cv: float = 1.0  # gamma: coefficient of variation of the gaps
    burst_size: int = 8  # burst: requests arriving together
    prompt_len: str = "uniform:64,512"
    output_len: str = "uniform:32,256"
    max_tokens: int | None = None
    ignore_eos: bool = False
    prefix_groups: int = 0  # shared system prompts; 0: none
    prefix_len: str = "fixed:256"
    prefix_fraction: float = 1.0  # share of requests that use a group's prefix
    turns: str = "fixed:1"  # turns per conversation
    think_time: float = 5.0  # mean seconds between a turn and the next (exponential)
    sessions: bool = False  # multi-turn conversations carry session_id "conv<N>" (U1)
    priorities: str = ""  # "0:0.2,1:0.8": class:weight; empty: all priority 0
    seed: int = 0

    def validate(self) -> None:
        if not 1 <= self.num_requests <= MAX_REQUESTS:  # QA: 10^12 was numpy's MemoryError
            raise WorkloadError(f"num_requests must be in [1, {MAX_REQUESTS:,}], got "
                                f"{self.num_requests}")
        if self.seed < 0:  # numpy's generators take none
            raise WorkloadError(f"seed must be >= 0, got {self.seed}")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise WorkloadError(f"rate must be a positive number of requests per second, "
                                f"got {self.rate}")
        if self.arrival not in ARRIVALS:
            raise WorkloadError(f"unknown arrival process {self.arrival!r}; known: "
                                f"{', '.join(ARRIVALS)}")
        if not MIN_CV <= self.cv <= MAX_CV:  # past these the gamma's shape over/underflows
            raise WorkloadError(f"cv must be in [{MIN_CV:g}, {MAX_CV:g}], got {self.cv}")
        if self.burst_size < 1:
            raise WorkloadError(f"burst_size must be >= 1, got {self.burst_size}")
        if not 0 <= self.prefix_groups <= self.num_requests:
            raise WorkloadError(f"prefix_groups must be in [0, num_requests], got "
                                f"{self.prefix_groups}")
        if not 0 <= self.prefix_fraction <= 1:
            raise WorkloadError(f"prefix_fraction must be in [0, 1], got {self.prefix_fraction}")
        if not (self.think_time >= 0 and math.isfinite(self.think_time)):  # QA: nan was 0
            raise WorkloadError(f"think_time must be a number of seconds >= 0, got "
                                f"{self.think_time}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise WorkloadError(f"max_tokens must be >= 1, got {self.max_tokens}")
        parse_priorities(self.priorities)


def parse_priorities(text: str) -> tuple[list[int], list[float]]:
    if not text:
        return [0], [1.0]
    classes, weights = [], []
    for item in text.split(","):
        name, _, weight = item.partition(":")
        try:
            classes.append(int(name))
            weights.append(float(weight) if weight else 1.0)
        except ValueError:
            raise WorkloadError(f"priorities {text!r}: write class:weight pairs, "
                                "e.g. 0:0.2,1:0.8") from None
    if not all(0 <= w < math.inf for w in weights) or sum(weights) <= 0:  # NaN fails too
        raise WorkloadError(f"priorities {text!r}: weights must be finite numbers >= 0, not "
                            "all 0")
    if len(set(classes)) < len(classes):  # QA: 0:1,0:1 taken
        raise WorkloadError(f"priorities {text!r}: a class is given twice")
    return classes, weights


def arrival_times(spec: WorkloadSpec, rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` arrival times starting at 0 with mean rate ``spec.rate``."""
    if spec.arrival == "poisson":
        gaps = rng.exponential(1.0 / spec.rate, count)
    elif spec.arrival == "gamma":
        shape = 1.0 / (spec.cv * spec.cv)
        gaps = rng.gamma(shape, 1.0 / (spec.rate * shape), count)
    else:
        num_bursts = -(-count // spec.burst_size)
        burst_gaps = rng.exponential(spec.burst_size / spec.rate, num_bursts)
        gaps = np.zeros(count)
        gaps[::spec.burst_size] = burst_gaps
    gaps[0] = 0.0
    return np.cumsum(gaps)


def generate(spec: WorkloadSpec) -> list[TraceRequest]:
    """``spec.num_requests`` requests (turns), sorted by arrival time."""
    spec.validate()
    prompt_dist = LengthDist.parse(spec.prompt_len)
    output_dist = LengthDist.parse(spec.output_len)
    turns_dist = LengthDist.parse(spec.turns)
    prefix_dist = LengthDist.parse(spec.prefix_len)
    classes, weights = parse_priorities(spec.priorities)
    probabilities = np.asarray(weights) / sum(weights)
    rng = np.random.default_rng(spec.seed)
    starts = arrival_times(spec, rng, spec.num_requests)
    group_prefix_lens = prefix_dist.sample(rng, max(spec.prefix_groups, 1))
    requests: list[TraceRequest] = []
    for conversation, start in enumerate(starts):
        if len(requests) >= spec.num_requests:
            break
        num_turns = max(1, int(turns_dist.sample(rng, 1)[0]))
        num_turns = min(num_turns, spec.num_requests - len(requests))
        requests.extend(_conversation(spec, rng, conversation, float(start), num_turns,
                                      prompt_dist, output_dist, group_prefix_lens,
                                      classes, probabilities))
    requests.sort(key=lambda r: (r.arrival_time, r.request_id))
    if requests[-1].arrival_time > MAX_TIME:
        raise WorkloadError(f"the trace would run to {requests[-1].arrival_time:.3g} s, past "
                            f"the {MAX_TIME:.0e} s a trace may span: raise --rate or lower "
                            "--think-time")
    return requests


def _conversation(spec: WorkloadSpec, rng: np.random.Generator, conversation: int,
                  start: float, num_turns: int, prompt_dist: LengthDist,
                  output_dist: LengthDist, group_prefix_lens: np.ndarray,
                  classes: list[int], probabilities: np.ndarray) -> list[TraceRequest]:
    prompt_lens = prompt_dist.sample(rng, num_turns)
    output_lens = output_dist.sample(rng, num_turns)
    think = rng.exponential(spec.think_time, num_turns) if spec.think_time > 0 \
        else np.zeros(num_turns)
    group = int(rng.integers(spec.prefix_groups)) if spec.prefix_groups else -1
    if group >= 0 and rng.random() >= spec.prefix_fraction:
        group = -1
    priority = classes[int(rng.choice(len(classes), p=probabilities))]
    out = []
    arrival, history = start, 0
    for turn in range(num_turns):
        new_text = max(1, int(prompt_lens[turn]))
        if num_turns > 1:
            # Each turn's prompt is the conversation so far plus new text, all from the
            # conversation's token stream, so the previous prompt and answer are a prefix.
            prompt_len = history + new_text
            prefix_id, prefix_len = f"{CONVERSATION}{conversation}", prompt_len
            request_id = f"c{conversation}-t{turn}"
        else:
            request_id = f"r{conversation}"
            prefix_id, prefix_len, prompt_len = None, 0, new_text
            if group >= 0:
                prefix_len = int(group_prefix_lens[group])
                prompt_len = prefix_len + new_text
                prefix_id = f"group{group}"
        output_len = int(output_lens[turn])
        out.append(TraceRequest(
            request_id=request_id, arrival_time=round(arrival, 6), output_len=output_len,
            prompt_len=prompt_len, prefix_id=prefix_id, prefix_len=prefix_len,
            max_tokens=spec.max_tokens, priority=priority, ignore_eos=spec.ignore_eos,
            session_id=f"{CONVERSATION}{conversation}" if spec.sessions and num_turns > 1
            else None))
        history = prompt_len + output_len
        arrival += float(think[turn])
    return out
