"""What an export is told: a run's table (:class:`ExportArgs`) or a rule's
(:class:`RuleExportArgs`); ``eval.export.cli`` turns them into flags and checks them
before any simulation."""

from __future__ import annotations

from dataclasses import dataclass, field

from envs.scenario import ScenarioArgs
from envs.workload import ARRIVALS

MAX_EPISODES = 1000
"""Most build or held-out episodes."""


@dataclass(frozen=True)
class ExportArgs:
    """Export a train.py run's policy as a bucketed lookup table (a rule as a table: python -m
    eval export --rule RULE --help)."""

    run_dir: str = ""
    """The train.py run directory (also accepted as the first positional argument)."""
    out: str = "tables/policy.json"
    """Where to write the table (JSON, written atomically)."""
    csv: str | None = None
    """Also write the table as CSV for people and spreadsheets."""
    buckets: int = 8
    """Buckets per feature (fewer when a feature takes fewer distinct values)."""
    max_features: int = 4
    """Features picked at most (greedily, by the held-out log error against the model)."""
    features: str | None = None
    """Comma-separated features to use instead of picking them, each with its own edges if
    given (``prefill_due_s:6:8:10``: buckets below 6, 6-8, 8-10 and from 10 on), else
    edges where the model's choice changes. A run across deployments may also name a
    deployment's features (prefill_tokens_per_itl, decode_floor_vs_itl, fixed_share,
    kv_prompts: envs/deployment.py), which its table, carrying, computes for the deployment
    it serves. A rule a table holds exactly (time-budget-deadline-kv) stands for its
    table's features at its own edges, for the table's SLO."""
    hardware: str | None = None
    """A run across deployments only: the table for this hardware (a preset,
    PRESET@field=value or a profile file), which the run need not have trained on, built
    from the model's decisions there alone, on the run's serving workload (or the traffic
    given: --arrival, --burstiness, --on-s, --off-s, --prompt, --output) around the model's
    own capacity there. The table is that deployment's, not one that carries."""
    model: str | None = None
    """The same for the model served (default: the run's serving model)."""
    arrival: str | None = field(default=None, metadata={"choices": list(ARRIVALS)})
    """With a deployment named: the arrivals of the traffic its table is built, chosen and
    checked on (unset: the run's serving workload's, as for each flag below)."""
    burstiness: float | None = None
    """With a deployment named: the gamma shape of --arrival gamma (1 is Poisson, below 1
    burstier; 1e-4 to 1e4)."""
    on_s: float | None = None
    """With a deployment named: the length of a burst of --arrival onoff, seconds."""
    off_s: float | None = None
    """With a deployment named: the pause between bursts of --arrival onoff, seconds."""
    prompt: str | None = None
    """With a deployment named: the prompt lengths (a length spec, as ``eval capacity`` takes)."""
    output: str | None = None
    """With a deployment named: the output lengths (a length spec)."""
    slo_ttft_s: float | None = None
    """The TTFT target the table serves, seconds (default: the run's serving SLO's)."""
    slo_itl_s: float | None = None
    """The ITL target the table serves, seconds (default: the run's serving SLO's)."""
    max_pass_itl: float | None = None
    """The longest pass the table makes while anyone decodes, in ITL targets (default:
    the run's cap, if it trained under one; a looser one than the run's is not taken: the
    model never learned what its actions above its cap do)."""
    build_episodes: int = 24
    """Episodes of the training conditions whose decisions build the table."""
    held_episodes: int = 8
    """Held-out episodes for the agreement figure."""
    dagger_rounds: int = 2
    """Rounds of dataset aggregation (DAgger): the table drives the build and held-out
    episodes, the model labels every state it leads to, and features and cells are made
    again from all the decisions so far; the round whose table keeps most of the model's
    capacity and goodput at load on streams of its own is kept (0: the model's own
    decisions only)."""
    rules: str = ("time-budget-deadline:4,time-budget-deadline:16,time-budget-deadline-kv:4,"
                  "time-budget-deadline-kv:16,time-budget-slack:7")
    """Rules whose exact tables (as ``--rule`` writes them) compete with the DAgger rounds'
    tables on the same streams and measures; a rule's table is written where it keeps more
    of the model's capacity and goodput than every round's (comma-separated specs; "none":
    the rounds only). Only for runs acting in time."""
    select_streams: int = 3
    """Streams per final scenario (the serving one and its variants) on which the export
    chooses among the rounds', the rules' and the refined table, each seeded apart. Tables
    a few percent apart need more where each stream's capacity is jagged
    (docs/learning.md); each stream adds a capacity search and a run per table and
    scenario."""
    refine_streams: int = 0
    """Refine a table cell by cell in closed loop on this many streams of the serving
    scenario of their own (0: not at all): from the best there of the rounds' tables and
    one built from the model's decisions at its capacity, each cell tries the values the
    model takes in at least 1% of its decisions, and a value is kept where it raises the
    mean capacity under the SLO by more than 0.8%; two sweeps. The refined table then
    competes with the rounds and the rules on the choice's streams, like them (minutes to
    an hour: docs/learning.md gives the presets' times). Where the choice keeps another
    table the refined one is written to the run directory as refined_table.json; the
    search keeps its place there (refine_progress.json), and an export killed during it
    and started again with the same flags goes on from the last cell done."""
    refine_on: str = field(default="serving", metadata={"choices": ["serving", "final"]})
    """Where --refine-streams refines: the serving scenario, or "final": it and its variants
    (+3 ms per pass, a tight KV cache), each on that many streams, as the choice and the
    fidelity check judge."""
    fidelity_seeds: int = 5
    """Streams per capacity in the fidelity check (0: skip it)."""
    fidelity_requests: int = 600
    """Requests per stream of the fidelity check, the choice among the tables and the
    refinement."""
    workers: int | None = None
    """The fidelity check's, the choice's and the refinement's runs on a local Ray instance
    (default: all cores)."""


@dataclass(frozen=True)
class RuleExportArgs(ScenarioArgs):
    """Write a time-budget rule as a lookup table for a scenario's hardware, model and SLO;
    the table is checked against the rule at every pass of the scenario's stream
    (--num-requests, --seed, or a trace's window)."""

    rule: str = "time-budget-deadline"
    """The rule: time-budget[:FRACTION], time-budget-slack[:TOP], time-budget-deadline[:TOP] or
    time-budget-deadline-kv[:TOP]."""
    by: str | None = None
    """FEATURE:EDGE[:EDGE...]: one table holding several members of a rule family (--rule
    lists them, comma-separated, one per bucket), the deployment's FEATURE (envs/deployment.py:
    decode_floor_vs_itl, prefill_tokens_per_itl, fixed_share, kv_prompts) picking which. It
    carries within the range of FEATURE over envs/deployment.py's TRAINING_DEPLOYMENTS at
    this SLO (the deployments such a map is fitted on: docs/learning.md)."""
    out: str = "rule-table.json"
    """Where to write the table (JSON, written atomically)."""
    csv: str | None = None
    """Also write the table as CSV for people and spreadsheets."""
