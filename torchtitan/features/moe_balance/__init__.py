"""MoE load balancing: the expert-load tracker, the aux loss and the expert-bias update."""
