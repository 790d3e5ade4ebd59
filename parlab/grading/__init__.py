"""Grading a class's labs: `python -m parlab grade`.

command.py    the command line and the whole procedure (its docstring says what is trusted and why)
official.py   the official labs, read before any student code runs; which lab a submission is
markers.py    the lab format: the markers of a lab's cells, the handout made from a solution, verdict lines
scores.py     a submission's score against the solution's verdicts, and the table of a class
grader.py     each submission in a fresh kernel, scratch folder and sandbox; its checks judged here
worker.py     the process that executes one assembled submission
isolation.py  what keeps one submission from reaching the grader, the package or the next submission
gradebook.py  a class at a time: one row per student and lab
labs/         each lab's checks (collect on live ranks, judge here) and what they share (labs/__init__.py)
"""
