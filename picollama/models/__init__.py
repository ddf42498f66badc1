"""picollama.models"""
