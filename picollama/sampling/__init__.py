"""picollama.sampling"""
