"""The eval itself (torch): drafter config and model, kernels, checkpoint and cache loading, target extraction,
metrics and the run loop."""
