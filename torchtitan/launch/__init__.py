"""Starting, owning and ending a run (see docs/reliability.md, "Errors and launching").

failures.py      why a rank failed: classified (a user or storage error is one line, a bug keeps its
                 traceback), recorded in torchelastic's per-rank error file, told once by the launcher
launcher.py      ``python -m torchtitan.launch TORCHRUN_ARGS``: torchrun, whose failures are printed
                 as one line per distinct error with the ranks that raised it
entry.py         the entry points' way to the launcher (torch imported with c10d's C++ log level quiet);
                 ``python -m torchtitan.preflight_launch`` adds the pre-launch check before the ranks
run_folder.py    one live run per dump folder (``run.lock``: host and pid), a folder that cannot be
                 written (found before launch), metrics.jsonl cut mid-line
parent_watch.py  a rank stops when its launcher dies, so an orphaned run does not train on
node_watch.py    multi-node: the launchers watch each other through the rendezvous store; a node that
                 dies is told by the others in one line (the node, the checkpoint to resume from)

Nothing here imports torch at import time except launcher.py, which the ranks never import.
"""
