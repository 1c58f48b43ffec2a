"""The config tree's sections, a module each: the training loop's, and each optional feature's."""
