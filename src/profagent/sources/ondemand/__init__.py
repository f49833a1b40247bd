"""sources/ondemand"""
