"""picollama.tools"""
