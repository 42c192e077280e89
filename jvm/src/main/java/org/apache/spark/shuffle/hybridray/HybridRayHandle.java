package org.apache.spark.shuffle.hybridray;

/** A shuffle whose data goes through hybrid_ray (any other handle is Spark's own shuffle). */
public interface HybridRayHandle {
  /** hybrid_ray's id of this shuffle ({@code spark-<app>-<shuffle id>}). */
  String shuffleKey();
}
