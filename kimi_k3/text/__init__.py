"""Text in and out: the tokenizer (``tokenizer``) and the chat format with its reply
parser (``chat``).
"""
