"""Optional features, a folder each (its pre-launch check and builders), and the registry that names them."""
