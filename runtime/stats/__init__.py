"""What the engine measures about itself: per-step phase timing and batch histograms
(step_timing.py), the online fit of the step cost the router reads (step_cost.py), torch
profiler traces of engine steps (profiler.py), and what each tensor-parallel rank reports for
/metrics (rank_stats.py)."""
