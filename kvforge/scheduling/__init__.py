"""kvforge.scheduling"""
