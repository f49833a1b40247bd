"""sources/traces"""
