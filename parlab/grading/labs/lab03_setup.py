"""What lab 03's parts share: the library code no part may call (parlab/grading/labs/guard.py). Its checks live in
lab03_pipeline_1f1b.py (the lab's module), lab03_capped.py and lab03_zero_bubble.py, which all read this list."""

# parlab's schedules, V schedules, executor and the lesson's helpers: the lab asks for the student's own.
LIBRARY = (
    "schemes/pipeline/schedules.py",
    "schemes/pipeline/schedules_v.py",
    "schemes/pipeline/executor.py",
    "lessons/pipeline.py",
)
