"""kvforge.disagg"""
