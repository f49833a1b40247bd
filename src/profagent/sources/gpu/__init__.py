"""sources/gpu"""
