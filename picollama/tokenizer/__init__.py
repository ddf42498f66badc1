"""picollama.tokenizer"""
