"""sources/stacks"""
