"""picollama.quant"""
