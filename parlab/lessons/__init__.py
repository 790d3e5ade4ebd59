"""Each lesson's demos and figures (one module per lesson, named after its scheme), the slideshow metadata
(slides.py) and the figure export (figures.py, `python -m parlab figures`). The schemes themselves are in
parlab/schemes; a lesson module runs and draws them.
"""
