"""Pipeline parallel: the stage layout, the stages and their schedule."""
