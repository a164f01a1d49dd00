"""Every seed range the project draws arrivals from, named in one place.

Training episodes draw their stream seeds below ``EVAL_SEED_BASE``; everything that
evaluates uses seeds from it up, each purpose in its own range, so no evaluation ever
replays arrivals a policy trained on, and two purposes never share streams.
"""

EVAL_SEED_BASE = 2**30
"""First seed of held-out arrivals; training draws below it."""
PERIODIC_EVAL_SEEDS = EVAL_SEED_BASE
"""train.py's periodic evaluation (model selection) and eval compare/suite streams."""
FINAL_EVAL_SEEDS = EVAL_SEED_BASE + 1000
"""train.py's final comparison (never seen by model selection)."""
CAPACITY_SEEDS = EVAL_SEED_BASE + 2000
"""Capacity bisection probes."""
TABLE_BUILD_SEEDS = EVAL_SEED_BASE + 5000
"""Streams whose decisions a lookup table is built from."""
TABLE_FIDELITY_SEEDS = EVAL_SEED_BASE + 6000
"""Held-out streams of a table's fidelity check."""
TABLE_SELECT_SEEDS = EVAL_SEED_BASE + 7000
"""Streams on which the export chooses among its candidate tables (not those it reports)."""
TABLE_REFINE_SEEDS = EVAL_SEED_BASE + 8000
"""Streams on which the export refines a table's cells by closed-loop capacity."""
SEARCH_CONFIRM_SEEDS = EVAL_SEED_BASE + 9000
"""Fresh held-out episodes on which agents.search confirms the model it kept (never those it
kept it on)."""
SEARCH_HELD_STREAMS = EVAL_SEED_BASE + 10000
"""Held-out streams on which agents.search's capacity objective compares a searched model
with its start (never those eval capacity reports on)."""
