"""picollama.backends"""
