"""What every step is made of: the batch, the step function, loss, optimizers, the seams features fill."""
