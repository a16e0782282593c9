"""kvforge.routing"""
