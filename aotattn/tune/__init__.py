"""The tuner: each tuning cell's configuration chosen at GPU-filling sizes (docs/tuner.md).

The core (tasks, candidates, timing, accuracy gate, export) knows no task queue; the
``aotattn tune`` commands run it on pgdef or from an offline batch file. Importing this
package touches neither the GPU nor Triton.
"""
