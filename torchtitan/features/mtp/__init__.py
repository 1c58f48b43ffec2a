"""Multi-token prediction (model.mtp_layers): its loss and metrics in the step, and its pre-launch check."""
