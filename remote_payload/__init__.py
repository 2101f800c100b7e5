"""reval's server half: a self-contained DFlash drafter eval. Never imports orchestrator."""
__version__ = "0.1.0"
