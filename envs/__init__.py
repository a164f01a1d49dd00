"""chunkpilot's simulator (standard library + numpy only) and its Gymnasium adapter.

The simulator modules (``profiles``, ``cost``, ``workload``, ``engine``, ``metrics``,
``scenario``, ``probe``, ``simulate``) never import gymnasium, torch or
stable-baselines3.
"""
