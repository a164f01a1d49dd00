"""A scenario: hardware x model x workload x engine settings x SLO, from flat fields.

The simulator's CLIs, the Gymnasium environment, training and evaluation all take
the same fields, so one scenario means the same thing everywhere. A scenario
replays a trace when ``trace`` is set and otherwise draws a seeded synthetic
stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from envs.actions import MAX_PASS_ITL, MIN_PASS_ITL
from envs.cost import Roofline
from envs.deployment import Deployment, deployment
from envs.pricing import Coefficients
from envs.engine import EngineConfig, Simulator
from envs.errors import MAX_TOKENS, ConfigError, did_you_mean, integer, non_negative, number, require
from envs.metrics import SLO
from envs.profiles import MAX_OVERHEAD_S, HardwareProfile, ModelProfile, get_hardware, get_model
from envs.workload import (MAX_SECONDS, SyntheticSpec, Workload, check_rate, load_trace,
                           parse_lengths)


def check_max_pass_itl(value) -> None:
    """An operator's cap on the longest pass (``Scenario.max_pass_itl``): unset, or within the
    action ladder's range of ITL targets."""
    if value is not None:
        number("max_pass_itl", value, MIN_PASS_ITL, MAX_PASS_ITL)


@dataclass(frozen=True)
class Scenario:
    """Hardware, model, workload, engine settings and SLO of one simulated deployment."""

    hardware: str = "h100-sxm"
    """Hardware preset (h100-sxm, h200, a100-80g, l40s, m5-max, h100-sxm-datasheet,
    a100-80g-datasheet) or a .toml/.json profile."""
    model: str = "llama-3-8b"
    """Model preset (llama-3-8b, llama-3-8b-q4, llama-3-70b-tp4, llama-3-70b-tp8, mistral-7b,
    qwen2.5-32b) or a .toml/.json profile."""
    per_pass_overhead_s: float | None = None
    """Fixed cost per pass in seconds (default: the hardware profile's)."""
    trace: str | None = None
    """CSV trace (arrival_s,prompt_tokens,output_tokens) to replay; unset: synthetic arrivals."""
    rate_scale: float = 1.0
    """Trace replay speed: 2 doubles the arrival rate."""
    window_start_s: float = 0.0
    """Replay only trace requests arriving at or after this time (trace seconds)."""
    window_end_s: float | None = None
    """Replay only trace requests arriving before this time (trace seconds)."""
    max_requests: int | None = None
    """Replay at most this many trace requests."""
    rate: float = 4.0
    """Synthetic: mean arrival rate, requests per second."""
    num_requests: int = 1000
    """Synthetic: number of requests."""
    arrival: str = field(default="poisson", metadata={"choices": ["poisson", "gamma", "onoff"]})
    """Synthetic: arrival process."""
    burstiness: float = 1.0
    """Synthetic: gamma shape for arrival=gamma (1 is Poisson, below 1 burstier)."""
    on_s: float = 10.0
    """Synthetic: length of a burst for arrival=onoff, seconds."""
    off_s: float = 10.0
    """Synthetic: silence between bursts for arrival=onoff, seconds."""
    prompt: str = "short-long"
    """Synthetic: prompt lengths (fixed:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MAX],
    empirical:PATH, mix:W*SPEC+W*SPEC, short-long)."""
    output: str = "lognormal:128:0.8:1024"
    """Synthetic: output lengths, same forms as --prompt."""
    sharing: str = "none"
    """Synthetic: shared prompt prefixes, served with prefix caching (envs/sharing.py):
    none; conversation:TURNS[:USERS] (each turn resends the conversation so far, --prompt
    its new text; USERS conversations at a time); agent:HIT[:PREFIXES] (a shared prefix,
    the share HIT of prompt tokens, before each request's own --prompt text)."""
    seed: int = 0
    """Seed of the synthetic stream."""
    max_num_seqs: int = 256
    """Most requests running at once (vLLM's max_num_seqs)."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's chunk per pass; 0 means no cap."""
    gpu_memory_utilization: float = 0.9
    """Share of device memory for weights and KV cache."""
    num_kv_blocks: int | None = None
    """KV-cache capacity in 16-token blocks (default: derived from memory)."""
    prefix_caching: bool = True
    """Automatic prefix caching, as vLLM V1 serves by default: requests whose prompts name
    their blocks (a trace's block_hashes column) reuse the KV of prefixes still cached;
    without such names it changes nothing. --no-prefix-caching prices every prompt token."""
    trace_block_tokens: int = 512
    """Tokens per id of a trace's block_hashes column (512: the Mooncake trace's)."""
    slo_ttft_s: float = 2.0
    """TTFT target, seconds."""
    slo_itl_s: float = 0.1
    """ITL target, seconds."""
    max_pass_itl: float | None = None
    """The longest pass a controller may make while anyone decodes, in multiples of the ITL
    target (the stall an operator tolerates; unset: up to 16, the action ladder's top).
    Every adaptive policy honours it (rules, tables, the learned policy and the
    environment's actions); a static budget is the engine's own setting and is not capped."""

    def __post_init__(self) -> None:
        """Every scalar is range-checked when a scenario is made (a CLI's arguments before any
        work); :meth:`check` reads what the scenario names (profiles, trace, length specs)."""
        for name, cls in (("hardware", HardwareProfile), ("model", ModelProfile)):
            value = getattr(self, name)
            require(isinstance(value, cls) or (isinstance(value, str) and bool(value.strip())), name,
                    value, "must be a preset name or a .toml/.json profile")
        if self.per_pass_overhead_s is not None:
            non_negative("per_pass_overhead_s", self.per_pass_overhead_s, MAX_OVERHEAD_S)
        if self.trace is not None:
            require(isinstance(self.trace, str) and bool(self.trace.strip()), "trace", self.trace,
                    "must be a CSV path or a bundled trace name")
        check_rate("rate_scale", self.rate_scale)
        non_negative("window_start_s", self.window_start_s, MAX_SECONDS)
        if self.window_end_s is not None:
            number("window_end_s", self.window_end_s, self.window_start_s, MAX_SECONDS, low_open=True)
        if self.max_requests is not None:
            integer("max_requests", self.max_requests, 1)
        integer("seed", self.seed)
        integer("trace_block_tokens", self.trace_block_tokens, 1, MAX_TOKENS)
        check_max_pass_itl(self.max_pass_itl)
        self.synthetic_spec()  # each of these checks its own fields
        self.engine_config()
        self.slo()

    def check(self) -> "Scenario":
        """Read everything the scenario names, so that a bad profile, trace or length spec is
        refused before a sweep starts: the profiles (and whether the model fits the memory),
        the trace and its window, or the synthetic length specs."""
        self.engine_config().kv_blocks(self.hardware_profile(), self.model_profile())
        if self.trace:
            self.arrivals()
        else:
            parse_lengths(self.prompt, "prompt", "prompt_tokens")
            parse_lengths(self.output, "output", "output_tokens")
        return self

    def hardware_profile(self) -> HardwareProfile:
        return get_hardware(self.hardware, self.per_pass_overhead_s)

    def model_profile(self) -> ModelProfile:
        return get_model(self.model)

    def simulator_cost(self) -> Coefficients:
        """The cost model the simulator prices this scenario's passes with."""
        return Roofline.of(self.hardware_profile(), self.model_profile()).coefficients()

    def kv_tokens(self) -> int:
        """The KV cache's capacity in tokens."""
        config = self.engine_config()
        return config.kv_blocks(self.hardware_profile(), self.model_profile()) * config.block_size

    def deployment(self) -> Deployment:
        """What identifies this deployment to a policy serving many (``envs.deployment``): its
        cost model, KV cache and SLO pair, as the simulator's state observes them."""
        return deployment(self.simulator_cost(), self.slo_ttft_s, self.slo_itl_s, self.kv_tokens())

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_num_seqs=self.max_num_seqs,
                            long_prefill_token_threshold=self.long_prefill_token_threshold,
                            gpu_memory_utilization=self.gpu_memory_utilization,
                            num_kv_blocks=self.num_kv_blocks,
                            enable_prefix_caching=self.prefix_caching)

    def slo(self) -> SLO:
        return SLO(self.slo_ttft_s, self.slo_itl_s)

    def max_pass_s(self) -> float | None:
        """The controllers' cap on a pass with decodes running, seconds (None: no cap)."""
        return None if self.max_pass_itl is None else self.max_pass_itl * self.slo_itl_s

    def synthetic_spec(self) -> SyntheticSpec:
        return SyntheticSpec(rate=self.rate, num_requests=self.num_requests, arrival=self.arrival,
                             burstiness=self.burstiness, on_s=self.on_s, off_s=self.off_s,
                             prompt=self.prompt, output=self.output, sharing=self.sharing)

    def arrivals(self, seed: int | None = None) -> Workload:
        """The scenario's requests; ``seed`` overrides the synthetic seed."""
        if self.trace:
            return load_trace(self.trace, self.rate_scale, self.window_start_s, self.window_end_s,
                              self.max_requests, self.trace_block_tokens)
        return self.synthetic_spec().build(self.seed if seed is None else seed)

    def stream(self, i: int, n: int, seed_base: int, num_requests: int | None = None) -> Workload:
        """Stream ``i`` of :meth:`streams` (a synthetic one is built alone)."""
        if not self.trace:
            base = self if num_requests is None else self.with_fields(num_requests=num_requests)
            return base.arrivals(seed_base + i)
        return self.streams(n, seed_base, num_requests)[i]

    def streams(self, n: int, seed_base: int, num_requests: int | None = None) -> list[Workload]:
        """``n`` independent streams of this scenario's arrivals: synthetic streams seeded
        ``seed_base``, ``seed_base + 1``, ...; for a trace, its replay window cut into ``n``
        consecutive parts of equal duration (the whole window when ``n`` is 1).
        ``num_requests`` caps each stream."""
        if not self.trace:
            base = self if num_requests is None else self.with_fields(num_requests=num_requests)
            return [base.arrivals(seed_base + i) for i in range(n)]
        w = self.arrivals()
        parts = [w] if n == 1 else [w.window(i * w.duration_s / n, (i + 1) * w.duration_s / n)
                                    for i in range(n)]
        return [p.head(num_requests) if num_requests else p for p in parts]

    def at_load(self, factor: float) -> "Scenario":
        """The scenario with its arrival rate (synthetic) or trace speed-up multiplied by
        ``factor``."""
        if self.trace:
            return self.with_fields(rate_scale=self.rate_scale * factor)
        return self.with_fields(rate=self.rate * factor)

    def simulator(self, workload: Workload | None = None, **kwargs) -> Simulator:
        return Simulator(self.hardware_profile(), self.model_profile(),
                         workload if workload is not None else self.arrivals(),
                         self.engine_config(), **kwargs)

    def with_fields(self, **changes) -> "Scenario":
        return replace(self, **changes)

    def fields_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(Scenario)}


# Named workloads: Scenario fields that describe the traffic alone.
WORKLOADS: dict[str, dict] = {
    # DESIGN.md's mix (70% short, 30% 4K-16K prompts) arriving in bursts (gamma shape
    # 0.5), at a load where the budget decides goodput on h100-sxm + llama-3-8b: static
    # budgets of 512-3,072 keep ~99% goodput, vLLM's 8,192 default drops to ~75%.
    "mixed-bursty": dict(trace=None, rate=8.0, arrival="gamma", burstiness=0.5,
                         prompt="short-long", output="lognormal:128:0.8:1024"),
    "mixed-poisson": dict(trace=None, rate=6.0, arrival="poisson", burstiness=1.0,
                          prompt="short-long", output="lognormal:128:0.8:1024"),
    "mixed-onoff": dict(trace=None, rate=5.0, arrival="onoff", on_s=10.0, off_s=10.0,
                        prompt="short-long", output="lognormal:128:0.8:1024"),
    "azure-conv": dict(trace="azure_conv_2023"),
    "mooncake": dict(trace="mooncake_synthetic"),
    # The same requests with their prompts' block ids: 64% of prompt blocks a prefix seen
    # before (envs/data/README.md), served with prefix caching unless --no-prefix-caching.
    "mooncake-blocks": dict(trace="mooncake_synthetic_blocks"),
    # DESIGN.md's laptop part: short chats and 4K-8K documents, a few users at a time.
    "laptop": dict(trace=None, rate=0.05, arrival="poisson",
                   prompt="mix:0.7*uniform:32:512+0.3*uniform:4000:8000",
                   output="lognormal:200:0.5:800"),
}


def named_workload(name: str) -> dict:
    if name not in WORKLOADS:
        raise ConfigError(f"workload: unknown name {name!r}; {did_you_mean(name, WORKLOADS)}"
                          f"known: {', '.join(WORKLOADS)}")
    return dict(WORKLOADS[name])


@dataclass(frozen=True)
class ScenarioArgs(Scenario):
    """A command line's scenario: every field of :class:`Scenario` as a flag, and a named
    workload whose traffic fields are the defaults of those flags (``envs.cli.parse`` reads
    ``--workload`` first); a flag given beside it overrides that field."""

    workload: str | None = None
    """A named workload (envs/scenario.py's WORKLOADS): the defaults of the traffic flags
    (trace, rate, arrival, burstiness, on/off, prompt, output); each such flag given
    overrides it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.workload is not None:
            named_workload(self.workload)

    @classmethod
    def cli_defaults(cls, given: dict) -> dict:
        """The defaults a named workload sets (``given``: the flags as first parsed)."""
        return named_workload(given["workload"]) if given.get("workload") is not None else {}

    def scenario(self) -> Scenario:
        """The scenario these arguments describe (a plain Scenario: no other field)."""
        return Scenario(**self.fields_dict())
