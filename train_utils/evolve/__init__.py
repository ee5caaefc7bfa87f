"""``train.py --evolve``: YOLOv5's hyperparameter evolution (:mod:`.space`), the search's files
(:mod:`.record`), the search run here (:mod:`.search`) or as Ray Tune trials (:mod:`.ray_backend`).
"""
