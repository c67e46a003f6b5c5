"""Fleet simulator: the real engine (Learner, Syncer, placement, rebalance) on a virtual clock.

See `trainer.sim.runner` for the strategies and `trainer.bench` for the scenarios.
"""
