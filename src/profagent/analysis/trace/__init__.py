"""analysis/trace"""
