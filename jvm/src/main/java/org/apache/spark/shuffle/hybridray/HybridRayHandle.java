package org.apache.spark.shuffle.hybridray;

/** A shuffle whose data goes through hybrid_ray (any other handle is Spark's own shuffle). */
public interface HybridRayHandle {
  /** hybrid_ray's id of this shuffle ({@code spark-<app>-<shuffle id>}). */
  String shuffleKey();

  /**
   * The driver's session token ("" if none), which executors send the actors with their
   * requests (see {@link HybridRayContext#SESSION_FIELD}). Carried here, in Spark's tasks,
   * because Spark's configuration is on spark-submit's command line.
   */
  String sessionToken();
}
