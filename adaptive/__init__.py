"""adaptive"""
