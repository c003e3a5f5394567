"""``posattn finetune``: fine-tune pretrained encoders and score them the way the papers do (GLUE protocol).

tasks.py (task definitions and fixed splits), glue.py (the official GLUE files), offline.py
(packaged labelled text and position-sensitive tasks), metrics.py (the official metrics),
batches.py (tokenising, truncation, length-sorted batches), run.py (training loop and resumable
sweep), report.py (results.json, report.md, plots), cli.py (the command).
"""
