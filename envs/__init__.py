"""chunkpilot's simulator (standard library + numpy only) and its Gymnasium adapter.

The simulator modules (``profiles``, ``cost``, ``workload``, ``engine``, ``metrics``,
``scenario``, ``probe``, ``simulate``) and the pure pieces of the learning problem
(``actions``, ``observation``, ``reward``, ``episodes``, ``seeds``) never import
gymnasium, torch or stable-baselines3 (``tests/test_architecture.py`` checks it);
only ``chunk_budget_env`` (the Gymnasium adapter) does. Calibration
(``envs.calibrate``) imports torch lazily, in its timing module alone.
"""

ENV_ID = "chunkpilot/ChunkBudget-v4"

try:  # registration is free when gymnasium is absent: the simulator needs none of it
    from gymnasium.envs.registration import register, registry
except ImportError:  # pragma: no cover - exercised by the no-gymnasium test
    pass
else:
    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point="envs.chunk_budget_env:ChunkBudgetEnv",
                 max_episode_steps=4096)
