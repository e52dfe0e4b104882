"""defenses"""
