"""minillm: the small LLM inference engine built in the book
"Build an LLM inference engine from scratch".

Every module except this one is exported from a chapter notebook in chapters/ (`make export`).
"""
__version__ = "0.1.0"
