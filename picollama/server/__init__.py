"""picollama.server"""
