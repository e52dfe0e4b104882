"""attacks"""
